"""The worker's states closed for good (gpu_wait.py `close_later` / `close_idle`, worker_core.py
`close`), without a GPU: a state whose close fails (here: its mapping still exported, so the unmap
raises) is logged and dropped, and every other state is still closed — at a step's start (the
force path past MAX_DEFERRED_CLOSES, `close_kept`), at `GpuWaits.close`, and at the worker's
`close`; and `reap` never closes one inside a forward."""

from __future__ import annotations

import time

import pytest

import pegaflow.gpu_wait as gpu_wait
from pegaflow.client import PegaflowClient
from pegaflow.connector.worker_core import WorkerCore
from pegaflow.gpu_wait import GpuWaits
from pegaflow.load_state import LoadState


class _Passed:
    """A retire event the stream is past (what `torch.cuda.Event` answers once it ran)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.fixture
def states():
    """`make(stuck=False)`: fresh load states, closed at the end; a stuck one's close raises
    (BufferError: its mapping is still exported) until the test lets it go."""
    made = []
    views = []

    def make(stuck: bool = False) -> LoadState:
        st = LoadState.create()
        made.append(st)
        if stuck:
            views.append(memoryview(st._mm))
        return st

    yield make
    for v in views:
        v.release()
    for st in made:
        st.close()


def test_past_the_bound_kept_states_close_at_a_steps_start_and_a_failing_close_drops_only_itself(
    states, monkeypatch
):
    """`reap` (at the end of a forward) only hands retired states back, each once, and keeps the
    ones closed for good: their unregister would wait for the queued kernels. Past
    MAX_DEFERRED_CLOSES `close_kept` (a step's start) closes them even with the stream busy. A
    close that fails is logged and dropped there, and the others still close (a raise inside
    `reap`, where the force path was, handed its earlier states back again at the next one)."""
    monkeypatch.setattr(gpu_wait, "MAX_DEFERRED_CLOSES", 1)
    gw = GpuWaits(lib=None, wait_fn=None)
    reused, stuck, closed = states(), states(stuck=True), states()
    free: list = []
    gw._retired = [(_Passed(), reused, free.append), (_Passed(), stuck, gw.close_later),
                   (_Passed(), closed, gw.close_later)]
    try:
        gw.reap()
        gw.reap()
        assert free == [reused], "a reused state was handed back twice"
        assert gw.retired == 0 and gw.closing == 2, "reap closed (unregistered) inside the forward"
        gw.close_kept()  # two kept, over the bound of one: closed with no look at the stream
        assert gw.closing == 0
        assert closed._mm.closed, "the state after the failing close stayed mapped"
        assert not reused._mm.closed
    finally:
        gw.close()


def test_closing_the_waits_stops_the_watchdog_and_closes_every_kept_state_even_if_one_fails(states):
    gw = GpuWaits(lib=None, wait_fn=None)
    guarded = states()
    gw.guard(guarded, time.monotonic() + 3600.0)  # the watchdog runs
    kept = [states(), states(stuck=True), states()]
    for st in kept:
        gw.close_later(st)
    gw.close()
    assert gw.closing == 0
    assert kept[0]._mm.closed and kept[2]._mm.closed, "a failing close kept the others mapped"
    assert gw._watchdog is not None and not gw._watchdog.is_alive(), "the watchdog outlived close"


def test_the_workers_close_closes_every_state_even_if_a_kept_one_fails_to_close(states):
    """WorkerCore.close: the retired states are handed back (`reap(block=True)`), the kept ones
    closed (`GpuWaits.close`), then the free list. A kept state whose close raised stopped it
    there: the free states stayed mapped and their shm files linked."""
    client = PegaflowClient("127.0.0.1:1", rpc_timeout_ms=200)  # never called: nothing registered
    w = WorkerCore(client, instance_id="review-close", namespace="ns-review-close")
    gw = w._gpu = GpuWaits(lib=None, wait_fn=None)
    attached, stuck, reusable, free = states(), states(stuck=True), states(), states()
    gw.close_later(stuck)  # kept for an idle stream
    gw._retired = [(_Passed(), attached, gw.close_later), (_Passed(), reusable, w._free_states.append)]
    w._free_states.append(free)
    try:
        w.close(unregister=False)
        assert attached._mm.closed, "a state retired for good was left mapped"
        assert reusable._mm.closed and free._mm.closed, "the free states were left mapped"
        assert gw.closing == 0 and gw.retired == 0 and w._free_states == []
    finally:
        client.close()
