"""An engine across a server restart, against real host-backend servers: the channel finds a
restarted server by itself (gRPC's backup poller is not what brings it back); a layer-wise wait
on a load whose server died ends when the rank's session drops (not at the load timeout); a
load lost with its server lets its request go once the rank registered anew (not 3 load
timeouts later); a session ended by an event of a kind the client does not know is
re-registered; and a query or Load that never reached any server (none was up) holds nothing,
as one that may still be copying does (gRPC and the local RPC socket)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional, Set

import pytest

from pegaflow._proto import pegaflow_pb2 as pb
from pegaflow.client import PegaflowClient
from pegaflow.connector.plan import ASYNC, LAYERWISE, LoadIntent, StepPlan
from pegaflow.connector.worker_core import WorkerCore
from pegaflow.load_state import LoadState

from kv_helpers import make_kv, register
from leaks import kill_and_clean
from server_proc import ServerProc, free_addr
from waits import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
#: The workers' load timeout in these tests: long enough that a wait ending at it is told apart
#: from one ending at the session's drop, short enough that a failing test ends.
LOAD_TIMEOUT_S = 20.0
#: What "promptly" means below: well under LOAD_TIMEOUT_S (and under 3 of them).
PROMPT_S = 8.0


@pytest.fixture
def own_server():
    """Starts servers of this test's own (`start(addr)`); all stopped at the end."""
    servers: List[ServerProc] = []

    def start(addr: str = "127.0.0.1:0", extra: Optional[List[str]] = None) -> ServerProc:
        s = ServerProc.start(addr, extra)
        servers.append(s)
        return s

    yield start
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGCONT)
        s.stop()


# ---- the channel finds a restarted server --------------------------------------------------

#: An engine rank in a process of its own, where gRPC's backup poller (which otherwise completes
#: a stalled connection attempt every 5 s) is off: only the client can bring its channel back.
_RANK = r"""
import sys, threading, time
from pegaflow.client import PegaflowClient
from kv_helpers import make_kv, register
addr, uid = sys.argv[1], sys.argv[2]
c = PegaflowClient(addr, rpc_timeout_ms=2000, reconnect_max_ms=200)
region, kv = make_kv(1, 8)
reg = register(c, kv, uid, "ns-" + uid)
assert reg.connected
print("REGISTERED", flush=True)
end = time.monotonic() + 60
while reg.connected and time.monotonic() < end:
    time.sleep(0.01)
print("LOST" if not reg.connected else "NOT LOST", flush=True)
sys.stdin.readline()  # the server is up again
t0 = time.monotonic()
while not reg.connected and time.monotonic() < t0 + 20:
    time.sleep(0.01)
print(f"BACK {time.monotonic() - t0:.3f}" if reg.connected else "NEVER", flush=True)
reg.close()
c.close()
region.close()
left = [t.name for t in threading.enumerate() if t.name.startswith("pegaflow")]
print(f"THREADS {left}", flush=True)
"""


def test_a_rank_re_registers_as_soon_as_its_restarted_server_is_up_without_grpcs_backup_poller(own_server, uid):
    """The rank's calls fail at once while the channel is down, and grpcio moves a connection
    attempt on only while something polls the channel: re-registration waited for gRPC's 5 s
    backup poller (1.5-7.5 s measured here with reconnect_max_ms=200), and without it never
    came. The client now drives the channel's reconnection itself."""
    addr = free_addr()
    s1 = own_server(addr)
    env = dict(os.environ, GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS="600000",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK, addr, uid], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env=env, text=True,
    )
    try:
        assert rank.stdout.readline().strip() == "REGISTERED"
        s1.kill()
        assert rank.stdout.readline().strip() == "LOST"
        own_server(addr)
        rank.stdin.write("up\n")
        rank.stdin.flush()
        back = rank.stdout.readline().strip()
        assert back.startswith("BACK"), f"the rank did not re-register within 20 s of the server being up: {back}"
        assert float(back.split()[1]) < PROMPT_S, back
        assert rank.stdout.readline().strip() == "THREADS []", "a thread of the client outlived its close()"
        assert rank.wait(30) == 0
    finally:
        kill_and_clean(rank)  # killed midway, the rank leaves its region file


# ---- a load whose server died ---------------------------------------------------------------


class _Rank:
    """One worker rank (host-backend KV of 2 layers) on `addr`, and a load of request "r" into
    blocks 2 and 3 that its server took and never finished: a load state the scheduler made and
    named in the plan (load_issuer "scheduler"), which no server writes, as when the server
    died mid-copy."""

    def __init__(self, addr: str, uid: str, mode: str):
        # A preemption waits for its transfers up to the save deadline: as long as a load timeout.
        self.client = PegaflowClient(addr, rpc_timeout_ms=2000, save_timeout_ms=int(LOAD_TIMEOUT_S * 1000),
                                     reconnect_max_ms=200)
        self.region, kv = make_kv(2, 8)
        self.layers = list(kv)
        self.worker = WorkerCore(self.client, instance_id=uid, namespace="ns-" + uid, mode=mode,
                                 load_timeout_s=LOAD_TIMEOUT_S)
        self.worker.register_kv_caches(kv)
        self.reg = self.worker.registration
        assert self.reg.connected
        self.state = LoadState.create()  # the scheduler's, armed: pending
        self.worker.bind(StepPlan(loads=[LoadIntent("r", b"\x01" * 16, [2, 3], states={(0, 0): self.state.name})]))
        self.worker.start_load()

    def close(self) -> None:
        self.state.mark_failed()  # frees a wait a failing test left behind
        self.worker.close(unregister=False)
        self.client.close()
        self.region.close()
        self.state.close()


def _in_thread(f: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=f, daemon=True)
    t.start()
    return t


def test_a_layerwise_wait_on_a_load_whose_server_died_ends_when_the_session_drops(own_server, uid):
    """The forward waited for layer 0 until the load timeout (60 s by default) when the server
    died mid-load, although the rank's session saw it go at once. Now the wait ends with the
    session; the load is failed (recomputed) and its blocks stay held until the server settles
    it or the rank is registered anew."""
    s = own_server()
    rank = _Rank(s.addr, uid, LAYERWISE)
    try:
        w = rank.worker
        ended: List[float] = []
        waiter = _in_thread(lambda: (w.wait_for_layer_load(rank.layers[0]), ended.append(time.monotonic())))
        s.kill()
        killed = time.monotonic()
        waiter.join(LOAD_TIMEOUT_S + 10)
        assert ended, "the layer wait never returned"
        assert ended[0] - killed < PROMPT_S, f"the layer wait ended {ended[0] - killed:.1f} s after the server died"
        w.wait_for_save()
        assert w.take_load_errors() == {2, 3}
        assert w.stats["load_failures"] == 1
        sending, _ = w.get_finished({"r"})
        assert sending is None, "its blocks were let go while the server may still be writing them"
    finally:
        rank.close()


def test_a_load_lost_with_its_server_lets_its_request_go_once_the_rank_is_registered_anew(own_server, uid):
    """A load whose server died kept its request's blocks, and held a preemption of it up to the
    save deadline, for 3 load timeouts (3 minutes by default): a dead server never settles the
    state. Registered anew, the rank knows no server will write it: the request is let go."""
    s = own_server()
    rank = _Rank(s.addr, uid, LAYERWISE)
    try:
        w = rank.worker
        s.kill()
        wait_for(lambda: not rank.reg.connected, "the session to see the server die")
        w.wait_for_layer_load(rank.layers[0])
        w.wait_for_save()
        assert w.take_load_errors() == {2, 3}
        assert w.get_finished({"r"}) == (None, None)
        own_server(s.addr)
        wait_for(lambda: rank.reg.connected, "re-registration")
        t0 = time.monotonic()
        w.handle_preemptions(["r"])  # returns once no transfer of "r" may land: at once now
        assert time.monotonic() - t0 < PROMPT_S
        assert w.get_finished(set()) == ({"r"}, None)
        assert w.stats["loads_abandoned"] == 1
    finally:
        rank.close()


def test_an_async_load_whose_server_died_fails_with_the_session_and_ends_once_registered_anew(own_server, uid):
    """Async mode: the load was reported failed only at the load timeout, and its request came
    back (finished_recving) only 3 load timeouts after it began. Now it fails when the session
    drops, and comes back once the rank is registered anew."""
    s = own_server()
    rank = _Rank(s.addr, uid, ASYNC)
    try:
        w = rank.worker
        assert w.get_finished(set()) == (None, None)
        s.kill()
        t0 = time.monotonic()
        errors: Set[int] = set()

        def reported() -> bool:
            w.get_finished(set())  # where an async load's end is seen
            errors.update(w.take_load_errors())
            return bool(errors)

        wait_for(reported, "the failed load to be reported", timeout_s=LOAD_TIMEOUT_S + 10)
        assert time.monotonic() - t0 < PROMPT_S
        assert errors == {2, 3}
        assert w.get_finished(set()) == (None, None), "its blocks were let go while the server may still write them"
        own_server(s.addr)
        wait_for(lambda: rank.reg.connected, "re-registration")
        assert w.get_finished(set()) == (None, {"r"})
        assert w.stats["loads_abandoned"] == 1
    finally:
        rank.close()


# ---- a session event this client does not know -----------------------------------------------


class _UnknownEvent:
    """A rank's real session, whose first read answers an event of a kind this client does not
    know (a newer server's), as a session the server ended with it."""

    def __init__(self, real):
        self.real, self.error = real, None

    def next_event(self):
        return pb.SessionEvent(kind=9, message="draining")

    def cancel(self) -> None:
        self.real.cancel()


def test_a_session_ended_by_an_event_of_an_unknown_kind_is_re_registered(server, uid):
    """The session thread named the event with `Kind.Name`, which raises ValueError for a kind
    it does not know: the thread died, and the rank was never registered again (the engine ran
    without PegaFlow for good)."""
    client = PegaflowClient(server.addr, reconnect_max_ms=200)
    region, kv = make_kv(1, 8)
    opened = []
    real_open = client.open_session

    def open_session(*a, **kw):
        s = real_open(*a, **kw)
        opened.append(s)
        return _UnknownEvent(s) if len(opened) == 1 else s

    client.open_session = open_session
    reg = register(client, kv, uid, "ns-" + uid)
    try:
        wait_for(lambda: reg.generation == 2 and reg.connected, "re-registration after the unknown event",
                 timeout_s=PROMPT_S)
        assert "session event kind 9: draining" in (reg.last_error or "")
    finally:
        reg.close()
        opened[0].cancel()
        client.close()
        region.close()


# ---- a call no server ever saw --------------------------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_probes_sent_while_no_server_is_up_hold_no_staging_blocks(own_server, tmp_path, uid, transport):
    """load_issuer "query": a probe whose QueryPrefetch fails in a way that may have reached the
    server keeps its staging run until its loads settle or 3 load timeouts pass. A probe that
    failed because no server could be reached at all (connection refused, the socket gone) was
    held so too: a few requests during an outage filled the staging room, and the engine got no
    PegaFlow hit for 3 load timeouts (3 minutes by default) after the server was back."""
    from pegaflow.hashes import synthetic_tokens

    from vllm_driver import BLOCK, Engine, Request, vllm_config

    sock = str(tmp_path / "pf.sock")
    s = own_server(extra=["--uds", sock])
    addr = "unix:" + sock if transport == "local" else s.addr
    fast = {"pegaflow.reconnect_max_ms": 200, "pegaflow.rpc_timeout_ms": 2000, "pegaflow.save_timeout_ms": 2000,
            "pegaflow.load_issuer": "query", "pegaflow.staging_blocks": 12}
    eng = Engine(vllm_config(addr, uid, "tiny-" + uid, LAYERWISE, **fast))
    reg = eng.worker._w().registration

    def prefill(rid: str, seed: int, avoid=frozenset()) -> int:
        r = Request(rid, synthetic_tokens(seed, 4 * BLOCK + 1), salt=uid)
        hit = eng.run_prefill(r, avoid=set(avoid))
        eng.finish(r)
        eng.drain(rid)
        return hit

    try:
        prefill("cold", 61)
        s.kill()
        wait_for(lambda: not reg.connected, "the session to see the server die")
        for i in range(3):  # 4 blocks asked each: the whole staging room, if held
            assert prefill(f"away{i}", 70 + i) == 0
        assert eng.sched.pegaflow_stats()["query_errors"] >= 3  # no server answered them
        own_server(s.addr, ["--uds", sock])
        wait_for(lambda: reg.connected, "re-registration")
        assert prefill("again", 61) == 0  # the new server starts empty
        assert prefill("warm", 61) == 4 * BLOCK, f"no staging blocks free: {eng.sched.pegaflow_stats()}"
    finally:
        eng.close()


def test_a_scheduler_issued_load_no_server_took_does_not_hold_its_request(own_server, tmp_path, uid):
    """load_issuer "scheduler": the probe hit, then the server died before the step's
    allocation sent the Load. It could not reach any server (the local RPC socket refused it),
    yet it was marked "answer lost" like a Load that may be copying: the request's blocks stayed
    held, with the server down, until the rank registered anew or 3 load timeouts passed. Now the
    Load counts as refused: the blocks are recomputed and the request finishes at once."""
    from pegaflow.hashes import synthetic_tokens

    from vllm_driver import BLOCK, Engine, Request, vllm_config

    sock = str(tmp_path / "pf.sock")
    s = own_server(extra=["--uds", sock])
    fast = {"pegaflow.reconnect_max_ms": 200, "pegaflow.rpc_timeout_ms": 2000, "pegaflow.save_timeout_ms": 2000,
            "pegaflow.load_issuer": "scheduler"}
    eng = Engine(vllm_config("unix:" + sock, uid, "tiny-" + uid, LAYERWISE, **fast))
    real_alloc = eng.sched.update_state_after_alloc

    def alloc_after_the_server_died(req, blocks, n):
        if n:
            s.kill()
        real_alloc(req, blocks, n)

    try:
        cold = Request("cold", synthetic_tokens(61, 4 * BLOCK + 1), salt=uid)
        eng.run_prefill(cold)
        eng.finish(cold)
        eng.drain("cold")
        eng.sched.update_state_after_alloc = alloc_after_the_server_died
        warm = Request("warm", synthetic_tokens(61, 4 * BLOCK + 1), salt=uid)
        assert eng.run_prefill(warm, avoid=set(cold.block_ids)) == 4 * BLOCK  # the probe hit
        assert eng.holds_all(warm, warm.num_tokens), "the failed load's blocks were not recomputed"
        assert eng.sched.pegaflow_stats()["load_issue_errors"] == 1
        eng.finish(warm)
        eng.drain("warm")  # while the server is still down
    finally:
        eng.close()
