"""The engine survives its KV server: killed, restarted on the same address,
or wedged. Queries answer 0 hits and saves are dropped and counted while it
is away (no exception reaches the step), the rank re-registers by itself
when it is back, and save/load then work again."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from pegaflow.errors import PegaflowError
from pegaflow.hashes import synthetic_tokens

from server_proc import ServerProc
from vllm_driver import BLOCK, Engine, Request, vllm_config
from waits import wait_for

FAST = {"pegaflow.reconnect_max_ms": 300, "pegaflow.rpc_timeout_ms": 2000, "pegaflow.save_timeout_ms": 2000}


@pytest.fixture
def own_server():
    servers = []

    def start(addr: str = "127.0.0.1:0") -> ServerProc:
        s = ServerProc.start(addr)
        servers.append(s)
        return s

    yield start
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGCONT)
        s.stop()


def test_after_a_server_restart_the_rank_re_registers_and_save_load_work_again(own_server, uid):
    s1 = own_server()
    eng = Engine(vllm_config(s1.addr, uid, "tiny-" + uid, "layerwise", **FAST))
    reg = eng.worker._w().registration
    try:
        cold = Request("cold", synthetic_tokens(61, 4 * BLOCK + 1), salt=uid)
        eng.run_prefill(cold)
        eng.finish(cold)
        eng.drain("cold")

        s1.kill()
        wait_for(lambda: not reg.connected, "the session to notice the dead server")
        # Server away: a miss, dropped (counted) saves, freed blocks; nothing raises into the step.
        away = Request("away", synthetic_tokens(61, 4 * BLOCK + 1), salt=uid)
        assert eng.run_prefill(away, avoid=set(cold.block_ids)) == 0
        assert eng.sched.pegaflow_stats()["query_errors"] >= 1
        assert eng.holds_all(away, away.num_tokens)
        eng.finish(away)
        eng.drain("away")
        assert eng.worker.pegaflow_stats()["saves_dropped"] == 4

        s2 = own_server(s1.addr)  # same address, empty pool
        wait_for(lambda: reg.connected, "re-registration")
        assert reg.generation == 2 and reg.stats()["disconnects"] == 1
        again = Request("again", synthetic_tokens(61, 4 * BLOCK + 1), salt=uid)
        assert eng.run_prefill(again) == 0  # the new server starts empty
        eng.finish(again)
        eng.drain("again")
        warm = Request("warm", synthetic_tokens(61, 4 * BLOCK + 1), salt=uid)
        assert eng.run_prefill(warm, avoid=set(again.block_ids)) == 4 * BLOCK
        assert eng.holds_all(warm, warm.num_tokens) and eng.invalid_blocks == set()
    finally:
        eng.close()


def test_a_wedged_server_costs_deadlines_not_a_hung_engine(own_server, uid):
    s = own_server()
    eng = Engine(vllm_config(s.addr, uid, "tiny-" + uid, "async", **{**FAST, "pegaflow.rpc_timeout_ms": 300, "pegaflow.save_timeout_ms": 300}))
    try:
        s.proc.send_signal(signal.SIGSTOP)
        r = Request("w", synthetic_tokens(71, 3 * BLOCK + 1), salt=uid)
        assert eng.run_prefill(r) == 0  # the query hit its deadline: a miss
        eng.finish(r)
        eng.drain("w")  # the save hit its deadline: dropped, and the blocks still come back
        stats = eng.worker.pegaflow_stats()
        assert stats["saves_dropped"] == 3 and stats["save_errors"] == 1
        s.proc.send_signal(signal.SIGCONT)
        r2 = Request("w2", synthetic_tokens(72, 3 * BLOCK + 1), salt=uid)
        eng.run_prefill(r2)
        eng.finish(r2)
        eng.drain("w2")
        assert eng.worker.pegaflow_stats()["blocks_saved"] == 3
    finally:
        s.proc.send_signal(signal.SIGCONT)
        eng.close()


def test_a_rank_whose_instance_was_cleaned_up_registers_again_by_itself(client, uid):
    from pegaflow.client import PegaflowClient

    from kv_helpers import make_kv, register, save_one

    region, kv = make_kv(2, 8)
    own = PegaflowClient(client.address, reconnect_max_ms=300)
    reg = register(own, kv, uid, "ns-" + uid)
    try:
        assert client.unregister_context(uid) == 0  # e.g. an operator, or a TP peer's session loss
        wait_for(lambda: reg.generation == 2 and reg.connected, "re-registration after CLEANED_UP")
        assert "CLEANED_UP" in (reg.last_error or "")
        assert save_one(own, kv, uid, 3, 7) == 1
    finally:
        reg.close()
        own.close()
        region.close()


def test_closing_a_registration_unregisters_the_instance(client, uid):
    from kv_helpers import make_kv, register

    region, kv = make_kv(1, 8)
    reg = register(client, kv, uid, "ns-" + uid)
    reg.close()
    assert not reg.connected
    with pytest.raises(PegaflowError) as e:
        client.query_prefetch(instance_id=uid, block_hashes=[b"\x01"], request_id="q")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "is not registered" in e.value.details
    region.close()


def test_a_registration_whose_client_was_closed_first_stops_its_session_thread(client, uid):
    """The client closed under a live registration ends its session for good: the session
    thread gives up once (it used to spin on the ended stream, ~90,000 laps a second)."""
    from pegaflow.client import PegaflowClient

    from kv_helpers import make_kv, register

    region, kv = make_kv(1, 8)
    own = PegaflowClient(client.address)
    reg = register(own, kv, uid, "ns-" + uid)
    try:
        own.close()
        reg._thread.join(5.0)
        assert not reg._thread.is_alive(), "the session thread still runs"
        assert reg._stats["disconnects"] == 1
        assert "closed" in (reg.last_error or "")
    finally:
        reg.close(unregister=False)  # the server cleaned the instance up when its session ended
        region.close()


def test_an_engine_started_before_its_server_registers_once_the_server_is_up(own_server, uid):
    """No server yet is not an error of the engine's: register() returns, the engine runs without
    PegaFlow (not connected), and the rank registers as soon as a server answers."""
    import socket

    from pegaflow.client import PegaflowClient

    from kv_helpers import make_kv, register, save_one

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # nothing listens there yet
    region, kv = make_kv(2, 8)
    c = PegaflowClient(addr, rpc_timeout_ms=1000, reconnect_max_ms=200)
    reg = register(c, kv, uid, "ns-" + uid)
    try:
        assert not reg.connected and reg.generation == 0
        assert "UNAVAILABLE" in (reg.last_error or "") or "DEADLINE" in (reg.last_error or "")
        own_server(addr)
        wait_for(lambda: reg.connected, "registration once the server is up")
        assert reg.generation == 1
        assert save_one(c, kv, uid, 2, 9) == 1
    finally:
        reg.close()
        c.close()
        region.close()


def test_a_registration_the_server_refuses_is_still_raised_at_once(client, uid):
    from kv_helpers import make_kv, register

    region, kv = make_kv(2, 8)
    try:
        with pytest.raises(PegaflowError) as e:
            register(client, kv, uid, "ns-" + uid, tp_rank=3, tp_size=2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        region.close()


def test_a_session_opened_while_the_registration_closes_is_cancelled_not_kept(client, uid):
    """close() racing a re-registration: the session opened after close() began is cancelled,
    and the registration never reads connected again."""
    from kv_helpers import make_kv, register

    region, kv = make_kv(1, 8)
    reg = register(client, kv, uid, "ns-" + uid)
    opened = []
    real_open = client.open_session

    def open_then_close(*a, **kw):
        s = real_open(*a, **kw)
        opened.append(s)
        reg.close(unregister=False)  # close() runs between the check and the session's install
        return s

    client.open_session = open_then_close
    try:
        reg._open_session()  # as the session thread would after re-registering
        assert not reg.connected
        assert reg._session is not opened[0], "a session opened past close() was installed"
        assert opened[0].next_event() is None, "the late session was left open"
    finally:
        client.open_session = real_open
        try:
            client.unregister_context(uid)
        except PegaflowError:
            pass  # its session ended with close(): the server may have cleaned it up already
        region.close()


class _EndsAtOnce:
    """A session that the path ends as soon as it is installed (its real stream stays open
    underneath, superseded by the next one): each generation's session ends at once."""

    def __init__(self, real):
        self.real, self.error = real, None

    def next_event(self):
        return None

    def cancel(self) -> None:
        self.real.cancel()


def test_sessions_that_end_at_once_are_re_registered_with_backoff_not_in_a_loop(client, uid):
    from pegaflow.client import PegaflowClient

    from kv_helpers import make_kv, register

    region, kv = make_kv(1, 8)
    own = PegaflowClient(client.address, reconnect_max_ms=300)
    opened = []
    real_open = own.open_session

    def open_session(*a, **kw):
        s = _EndsAtOnce(real_open(*a, **kw))
        opened.append(s)
        return s

    own.open_session = open_session
    reg = register(own, kv, uid, "ns-" + uid)
    try:
        time.sleep(1.0)
        # 50, 100, 200, 300, 300 ... ms between generations: a handful in a second, not hundreds.
        assert 2 <= reg.generation <= 10, f"{reg.generation} generations in 1 s"
    finally:
        reg.close()
        for s in opened:
            s.real.cancel()
        own.close()
        region.close()
