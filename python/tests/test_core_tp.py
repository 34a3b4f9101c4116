"""The core state machines with two TP ranks of one instance: each rank
registers and saves its own slot of every block, one query leases the prefix
for both, each rank consumes the lease with its own Load and gets back its own
bytes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List

import numpy as np

from pegaflow.client import PegaflowClient
from pegaflow.connector.core import ScheduledRequest, SchedulerCore, WorkerCore
from pegaflow.hashes import chained_block_hashes, synthetic_tokens

from kv_helpers import block_content, make_kv

BLOCK = 4


@dataclass
class Req:
    request_id: str
    tokens: List[int]
    salt: str

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def block_hashes(self) -> List[bytes]:
        return chained_block_hashes(self.tokens, BLOCK, self.salt)


def rank_content(h: bytes, rank: int, layer: int, seg: int) -> np.ndarray:
    return block_content(h + bytes([rank]), layer, seg)


def test_two_tp_ranks_save_their_own_slots_and_each_loads_its_own_bytes(server, uid):
    client = PegaflowClient(server.addr)
    regions, kvs, workers = [], [], []
    try:
        for rank in range(2):
            region, kv = make_kv(2, 16)
            regions.append(region)
            kvs.append(kv)
            w = WorkerCore(client, instance_id=uid, namespace="ns-" + uid, tp_rank=rank, tp_size=2)
            w.register_kv_caches(kv)
            workers.append(w)
        sched = SchedulerCore(client, instance_id=uid, block_size=BLOCK, mode="layerwise")
        a = Req("a", synthetic_tokens(91, 3 * BLOCK + 1), uid)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        sched.update_state_after_alloc(a, [1, 2, 3, 4], 0)
        plan = sched.build_step([ScheduledRequest("a", [1, 2, 3, 4], True, 0, a.num_tokens)])
        assert [s.block_ids for s in plan.saves] == [[1, 2, 3]]
        for rank, (w, kv) in enumerate(zip(workers, kvs)):
            for li, t in enumerate(kv.values()):
                for b, h in zip([1, 2, 3], a.block_hashes):
                    for s in range(2):
                        t[s, b] = rank_content(h, rank, li, s)
            w.bind(plan)
            w.start_load()
            w.wait_for_save()
            w.unbind()
        assert sched.request_finished(a) is True
        for w in workers:
            end = time.monotonic() + 30
            while w.get_finished({"a"})[0] != {"a"}:
                assert time.monotonic() < end, "rank never finished sending"
                time.sleep(0.01)
        sched.finished_sending({"a"})

        b = Req("b", list(a.tokens) + [5, 6, 7], uid)
        assert sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, False)
        sched.update_state_after_alloc(b, [9, 10, 11, 12], 3 * BLOCK)
        plan = sched.build_step([ScheduledRequest("b", [9, 10, 11, 12], True, 3 * BLOCK, 4)])
        assert len(plan.loads) == 1 and plan.loads[0].block_ids == [9, 10, 11]
        for w in workers:
            w.bind(plan)
            w.start_load()
            for name in kvs[0]:
                w.wait_for_layer_load(name)
            w.wait_for_save()
            assert w.take_load_errors() == set()
            w.unbind()
        for rank, kv in enumerate(kvs):
            for li, t in enumerate(kv.values()):
                for b_id, h in zip([9, 10, 11], b.block_hashes):
                    for s in range(2):
                        assert t[s, b_id].tobytes() == rank_content(h, rank, li, s).tobytes(), (rank, li, b_id, s)
        sched.close()
    finally:
        for w in workers:
            w.close()
        for r in regions:
            r.close()
        client.close()
