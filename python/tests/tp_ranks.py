"""Two TP ranks of one instance on the core state machines, for the tests
that run a prefix through both (test_core_tp.py, and the scheduler-issued
loads in test_connector_load_issuer.py): each rank's KV cache and worker,
each rank's own bytes in a block, the save step of a fresh request on every
rank, and the check that every rank got its own bytes back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from pegaflow.client import PegaflowClient
from pegaflow.connector.plan import StepPlan
from pegaflow.connector.scheduler_core import SchedulerCore
from pegaflow.connector.worker_core import WorkerCore
from pegaflow.hashes import chained_block_hashes

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
    """What rank `rank` holds in segment `seg` of layer `layer` of the block with hash `h`."""
    return block_content(h + bytes([rank]), layer, seg)


class TwoRanks:
    """Ranks 0 and 1 of instance `uid` (namespace "ns-<uid>"), 2 layers of 16
    blocks each, registered; `close()` closes the workers and the regions."""

    def __init__(self, client: PegaflowClient, uid: str) -> None:
        self.regions, self.kvs, self.workers = [], [], []
        try:
            for rank in range(2):
                region, kv = make_kv(2, 16)
                self.regions.append(region)
                self.kvs.append(kv)
                w = WorkerCore(client, instance_id=uid, namespace="ns-" + uid, tp_rank=rank, tp_size=2)
                w.register_kv_caches(kv)
                self.workers.append(w)
        except BaseException:
            self.close()
            raise

    def save_step(self, sched: SchedulerCore, plan: StepPlan, req: Req, block_ids: Sequence[int]) -> None:
        """Fills `block_ids` with each rank's bytes of `req`'s blocks, runs the
        step on every rank, finishes the request and waits until every rank
        sent its save."""
        for rank, (w, kv) in enumerate(zip(self.workers, self.kvs)):
            for li, t in enumerate(kv.values()):
                for b, h in zip(block_ids, req.block_hashes):
                    for s in range(2):
                        t[s, b] = rank_content(h, rank, li, s)
            w.bind(plan)
            w.start_load()
            w.wait_for_save()
            w.unbind()
        assert sched.request_finished(req) is True
        for w in self.workers:
            end = time.monotonic() + 30
            while w.get_finished({req.request_id})[0] != {req.request_id}:
                assert time.monotonic() < end, "rank never finished sending"
                time.sleep(0.01)
        sched.finished_sending({req.request_id})

    def assert_loaded(self, block_ids: Sequence[int], req: Req) -> None:
        """Every rank holds its own bytes of `req`'s blocks in `block_ids`."""
        for rank, kv in enumerate(self.kvs):
            for li, t in enumerate(kv.values()):
                for b_id, h in zip(block_ids, req.block_hashes):
                    for s in range(2):
                        assert t[s, b_id].tobytes() == rank_content(h, rank, li, s).tobytes(), (rank, li, b_id, s)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        for r in self.regions:
            r.close()
