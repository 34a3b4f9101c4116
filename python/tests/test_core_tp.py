"""The core state machines with two TP ranks of one instance: each rank
registers and saves its own slot of every block, one query leases the prefix
for both, each rank consumes the lease with its own Load and gets back its own
bytes."""

from __future__ import annotations

from pegaflow.client import PegaflowClient
from pegaflow.connector.plan import ScheduledRequest
from pegaflow.connector.scheduler_core import SchedulerCore
from pegaflow.hashes import synthetic_tokens

from tp_ranks import BLOCK, Req, TwoRanks


def test_two_tp_ranks_save_their_own_slots_and_each_loads_its_own_bytes(server, uid):
    client = PegaflowClient(server.addr)
    ranks = None
    try:
        ranks = TwoRanks(client, uid)
        sched = SchedulerCore(client, instance_id=uid, block_size=BLOCK, mode="layerwise")
        a = Req("a", synthetic_tokens(91, 3 * BLOCK + 1), uid)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        sched.update_state_after_alloc(a, [1, 2, 3, 4], 0)
        plan = sched.build_step([ScheduledRequest("a", [1, 2, 3, 4], True, 0, a.num_tokens)])
        assert [s.block_ids for s in plan.saves] == [[1, 2, 3]]
        ranks.save_step(sched, plan, a, [1, 2, 3])

        b = Req("b", list(a.tokens) + [5, 6, 7], uid)
        assert sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, False)
        sched.update_state_after_alloc(b, [9, 10, 11, 12], 3 * BLOCK)
        plan = sched.build_step([ScheduledRequest("b", [9, 10, 11, 12], True, 3 * BLOCK, 4)])
        assert len(plan.loads) == 1 and plan.loads[0].block_ids == [9, 10, 11]
        for w in ranks.workers:
            w.bind(plan)
            w.start_load()
            for name in ranks.kvs[0]:
                w.wait_for_layer_load(name)
            w.wait_for_save()
            assert w.take_load_errors() == set()
            w.unbind()
        ranks.assert_loaded([9, 10, 11], b)
        sched.close()
    finally:
        if ranks is not None:
            ranks.close()
        client.close()
