"""Review of WorkerCore's discards (worker_core.py): the hashes of saves computed over this rank's
failed layer-wise load, sent to the server as a Save's `discard_hashes` when the engine has more
than one rank. A discard the full save queue could not take waits for the rank's next job; at
shutdown (the connector's `shutdown` → `WorkerCore.close`) there is none: it was neither sent nor
counted in `discards_lost`, and neither were the discards of jobs a stuck save thread never took.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from pegaflow.client import PegaflowClient
from pegaflow.connector.plan import SaveIntent, StepPlan
from pegaflow.connector.worker_core import WorkerCore

BAD = [b"\x03" * 16, b"\x04" * 16]


def _worker(client, tp_size: int) -> WorkerCore:
    """A rank whose save thread runs and whose registration is up (no KV: Save is recorded)."""
    w = WorkerCore(client, instance_id="i", namespace="n", tp_rank=0, tp_size=tp_size, save_queue_depth=1)
    w.registration = SimpleNamespace(connected=True, stats=dict, close=lambda unregister=True: None)
    w._thread = threading.Thread(target=w._save_loop, daemon=True)
    w._thread.start()
    return w


def _step(w: WorkerCore, *saves: SaveIntent) -> None:
    w.bind(StepPlan(saves=list(saves)))
    w.wait_for_save()
    w.unbind()


def _fill_queue_then_fail(w: WorkerCore) -> None:
    """Job 1 is in the (blocked) save thread, job 2 fills the queue, then b's save computed over
    its failed load is dropped and its discard cannot be queued."""
    _step(w, SaveIntent("c", [5], [b"\x05" * 16]))
    end = time.monotonic() + 5
    while not w._queue.empty():
        assert time.monotonic() < end
        time.sleep(0.005)
    _step(w, SaveIntent("c", [6], [b"\x06" * 16]))
    w._failed_loads.add("b")
    _step(w, SaveIntent("b", [12, 13], list(BAD), ("b",)))


def _recording_client(gate: threading.Event, sent: list, save_timeout_ms: int) -> PegaflowClient:
    client = PegaflowClient("127.0.0.1:1", save_timeout_ms=save_timeout_ms)  # never dialled

    def save(**kw):
        gate.wait(30)
        sent.append(kw)
        return SimpleNamespace(blocks_saved=len(kw["block_ids"]), blocks_skipped=0, blocks_refused=0,
                               blocks_not_admitted=0, blocks_discarded=len(kw["discard_hashes"]))

    client.save = save
    return client


def test_a_discard_left_by_a_full_save_queue_is_sent_at_shutdown():
    """TP 2: the queue was full when b's discard came, and the engine shut down before another
    step: close() sent the queued saves and ended the thread, the discard was neither sent nor
    counted. It now goes as the last job, after the saves queued before it."""
    gate, sent = threading.Event(), []
    client = _recording_client(gate, sent, 10_000)
    try:
        w = _worker(client, tp_size=2)
        _fill_queue_then_fail(w)
        gate.set()
        w.close()
        assert [kw["discard_hashes"] for kw in sent] == [[], [], BAD], "the discard never reached the server"
        stats = w.stats_snapshot()
        assert stats["saves_discarded"] == 2 and stats.get("discards_lost", 0) == 0
    finally:
        client.close()


def test_a_discard_a_stuck_save_thread_never_sends_is_counted_lost_at_shutdown():
    """The same with a save thread stuck past the save deadline at shutdown: close() gives up on
    it (as before); the discard it could not hand over is counted in discards_lost and logged."""
    gate, sent = threading.Event(), []
    client = _recording_client(gate, sent, 200)
    try:
        w = _worker(client, tp_size=2)
        _fill_queue_then_fail(w)
        w.close()
        assert w.stats_snapshot().get("discards_lost", 0) == 2
    finally:
        gate.set()
        client.close()


def test_no_discard_for_a_single_rank_engine_at_shutdown():
    """TP 1: no other rank computed over the failed load; nothing is sent or counted."""
    gate, sent = threading.Event(), []
    client = _recording_client(gate, sent, 10_000)
    try:
        w = _worker(client, tp_size=1)
        _fill_queue_then_fail(w)
        gate.set()
        w.close()
        assert [kw["discard_hashes"] for kw in sent] == [[], []]
        stats = w.stats_snapshot()
        assert stats.get("saves_discarded", 0) == stats.get("discards_lost", 0) == 0
        assert stats["saves_dropped"] == 2  # b's, computed over its failed load
    finally:
        client.close()
