"""Two engines, one instance id: the server holds the rank for the engine that
registered it first, and a second engine (other regions) is refused with
"... is registered by another engine". The second does not count itself
registered, opens no session (which would supersede the first's) and so
never saves from or loads into the first's memory; it retries, and registers
once the first is gone (the engine that crashed and restarted before the
server saw its session end).

Run as a script, this file is the other engine's process (`_child`, `_holder`)."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pegaflow.client import PegaflowClient
from pegaflow.errors import PegaflowError
from pegaflow.load_state import LoadState
from pegaflow.regions import export_kv_layers

from kv_helpers import fill, make_kv, matches, register, save_one
from leaks import kill_and_clean
from waits import wait_for


def load_one(client: PegaflowClient, kv, instance_id: str, mark: int, dst: int, request_id: str) -> list:
    """Queries the block of hash `bytes([mark]) * 16`, loads it into block `dst` and returns the
    (layer, block, seg) triples that did not land byte-exact (empty: the round trip worked)."""
    h = bytes([mark]) * 16
    q = client.query_prefetch(instance_id=instance_id, block_hashes=[h], request_id=request_id)
    assert not q.loading and q.hits == 1, f"{instance_id}: query of {request_id} hit {q.hits}"
    with LoadState.create() as st:
        client.load(instance_id=instance_id, tp_rank=0, lease_id=q.lease_id, block_ids=[dst], load_state_shm=st.name)
        st.wait_all(timeout_s=30)
    return matches(kv, [dst], [h])


def _child(addr: str, instance_id: str, namespace: str) -> None:
    """The second engine: registers its own KV under `instance_id`, reports, waits for "go" on
    stdin (the first engine is gone by then), and reports again after a load round trip."""
    client = PegaflowClient(addr, rpc_timeout_ms=5000, reconnect_max_ms=200)
    region, kv = make_kv(2, 8)
    reg = register(client, kv, instance_id, namespace)  # must not raise: the rank is retried
    try:
        time.sleep(1.0)  # several retries
        report = dict(connected=reg.connected, superseded=reg.superseded, last_error=reg.last_error,
                      failures=reg.stats()["register_failures"])
        print(json.dumps(report), flush=True)
        sys.stdin.readline()
        up = reg.wait_connected(30)
        bad = load_one(client, kv, instance_id, 7, 6, "child") if up else ["not connected"]
        print(json.dumps(dict(connected=up, generation=reg.generation, bad=[list(b) for b in bad])), flush=True)
    finally:
        reg.close()
        client.close()
        region.close()


def _holder(addr: str, instance_id: str, namespace: str) -> None:
    """An engine that registers, says so, and runs until it is killed."""
    client = PegaflowClient(addr, rpc_timeout_ms=5000)
    region, kv = make_kv(2, 8)
    reg = register(client, kv, instance_id, namespace)
    try:
        print(json.dumps(dict(connected=reg.connected)), flush=True)
        sys.stdin.readline()
    finally:
        reg.close()
        client.close()
        region.close()


def _spawn(addr: str, instance_id: str, namespace: str, role: str) -> subprocess.Popen:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), role, addr, instance_id, namespace],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )


def _read_json(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "the second engine said nothing in time"
    line = proc.stdout.readline()
    assert line, f"the second engine exited (rc {proc.wait()})"
    return json.loads(line)


def test_a_second_engine_process_with_the_same_instance_id_is_refused_and_the_first_keeps_working(server, uid):
    client = PegaflowClient(server.addr, rpc_timeout_ms=10_000)
    region, kv = make_kv(2, 8)
    first = register(client, kv, uid, "ns-" + uid)
    child = None
    try:
        assert first.connected
        assert save_one(client, kv, uid, 0, 7) == 1
        child = _spawn(server.addr, uid, "ns-" + uid, "second")
        second = _read_json(child)
        assert not second["connected"] and not second["superseded"]
        assert f'instance "{uid}" tp_rank 0 pp_rank 0 is registered by another engine' in second["last_error"]
        assert "FAILED_PRECONDITION" in second["last_error"] and second["failures"] >= 2

        # The first engine still holds its rank and its session, and its KV round trip lands in its memory.
        assert first.connected and not first.superseded and first.generation == 1
        assert load_one(client, kv, uid, 7, 5, "first") == []

        first.close()  # unregisters: the rank is free, and the second engine takes it by itself
        child.stdin.write("go\n")
        child.stdin.flush()
        after = _read_json(child)
        assert after == dict(connected=True, generation=1, bad=[])
        assert child.wait(timeout=30) == 0
    finally:
        first.close()
        if child is not None:
            kill_and_clean(child)  # a child killed midway leaves its region file
        client.close()
        region.close()


def test_an_engine_restarted_after_a_crash_registers_once_the_server_sees_the_old_one_gone(server, uid):
    """The old engine (a child process) still holds the rank when the new one starts: the new
    one runs without PegaFlow and registers by itself once the old one is SIGKILLed (its
    session ends, the server cleans its instance up). A killed engine never unlinks its region
    file: the test does, by the child's pid."""
    old = _spawn(server.addr, uid, "ns-" + uid, "holder")
    client = PegaflowClient(server.addr, rpc_timeout_ms=10_000, reconnect_max_ms=200)
    region, kv = make_kv(2, 8)
    reg = None
    try:
        assert _read_json(old) == dict(connected=True)
        reg = register(client, kv, uid, "ns-" + uid)  # returns: the rank is retried
        assert not reg.connected and "is registered by another engine" in (reg.last_error or "")
        kill_and_clean(old)
        wait_for(lambda: reg.connected, "registration once the old engine is gone")
        assert reg.generation == 1 and not reg.superseded
        assert save_one(client, kv, uid, 2, 5) == 1
        assert load_one(client, kv, uid, 5, 7, "restarted") == []
    finally:
        kill_and_clean(old)
        if reg is not None:
            reg.close()
        client.close()
        region.close()


def test_two_engines_with_one_instance_id_racing_for_a_new_server_end_with_one_holder(uid):
    """Both engines start before the server, so both register from the retry thread: the
    loser must not take the winner's answer for its own (it used to count ALREADY_EXISTS as
    registered and open a session that superseded the winner's)."""
    from server_proc import ServerProc

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # nothing listens there yet
    engines = []
    srv = None
    try:
        for _ in range(2):
            c = PegaflowClient(addr, rpc_timeout_ms=5000, reconnect_max_ms=100)
            region, kv = make_kv(2, 8)
            engines.append((c, region, kv, register(c, kv, uid, "ns-" + uid)))
        assert not any(e[3].connected for e in engines)
        srv = ServerProc.start(addr)
        wait_for(lambda: any(e[3].connected for e in engines), "one engine to register")
        time.sleep(1.0)  # the loser retries meanwhile (backoff capped at 100 ms)
        up = [e for e in engines if e[3].connected]
        assert len(up) == 1, [(e[3].connected, e[3].superseded, e[3].last_error) for e in engines]
        (c, _, kv, reg), = up
        (_, _, other_kv, other), = [e for e in engines if e is not up[0]]
        assert not reg.superseded and not other.superseded
        assert "is registered by another engine" in (other.last_error or "")

        fill(other_kv, [1], [bytes([9]) * 16])  # a save from the wrong memory would carry it too
        assert save_one(c, kv, uid, 1, 9) == 1
        assert load_one(c, kv, uid, 9, 4, "holder") == []
        assert matches(other_kv, [4], [bytes([9]) * 16]) != [], "nothing landed in the other engine's memory"
        assert reg.connected and not other.connected
    finally:
        for c, region, _, reg in engines:
            reg.close()
            c.close()
            region.close()
        if srv is not None:
            srv.stop()


def test_the_same_registration_again_is_already_exists_and_another_is_failed_precondition(client, uid):
    from pegaflow.registration import held_by_another_engine

    region, kv = make_kv(2, 8)
    reg = register(client, kv, uid, "ns-" + uid)
    other_region, other_kv = make_kv(2, 8)
    try:
        with pytest.raises(PegaflowError) as same:
            reg._register_once()
        assert same.value.code == grpc.StatusCode.ALREADY_EXISTS
        layers, _ = export_kv_layers(other_kv)
        with pytest.raises(PegaflowError) as other:
            client.register_context(
                instance_id=uid, namespace="ns-" + uid, tp_rank=0, tp_size=1,
                layer_names=[l.name for l in layers], region_handles=[l.handle for l in layers],
                geometry=[l.geometry for l in layers],
            )
        assert held_by_another_engine(other.value), other.value
        assert reg.connected and not reg.superseded
    finally:
        reg.close()
        region.close()
        other_region.close()


def _next_event_within(session, timeout_s: float):
    """The session's next event from a helper thread: (ended, event). `ended` is False when
    the stream stayed open for `timeout_s` (the server took the session)."""
    box = []
    t = threading.Thread(target=lambda: box.append(session.next_event()), daemon=True)
    t.start()
    t.join(timeout_s)
    return (bool(box), box[0] if box else None)


def test_another_engines_session_for_a_held_rank_is_refused_and_the_holder_keeps_its_session(server, uid):
    """A second engine under the same instance id opens the rank's session (with no token, or a
    Python engine in a server-restart window): it must not supersede
    the holder's session, which stops a Python holder for good and whose end cleans it up."""
    client = PegaflowClient(server.addr, rpc_timeout_ms=10_000)
    other = PegaflowClient(server.addr, rpc_timeout_ms=10_000)
    region, kv = make_kv(2, 8)
    holder = register(client, kv, uid, "ns-" + uid)
    stray = None
    try:
        assert holder.connected
        stray = other.open_session(uid, 0, 0)
        ended, ev = _next_event_within(stray, 10.0)
        assert ended and ev is None, "the other engine's session was taken"
        assert stray.error is not None and stray.error.code == grpc.StatusCode.FAILED_PRECONDITION, stray.error
        assert f'instance "{uid}" tp_rank 0 pp_rank 0 is registered' in stray.error.details
        time.sleep(0.5)  # a SUPERSEDED event would have reached the holder by now
        assert holder.connected and not holder.superseded and holder.generation == 1, holder.last_error
        assert save_one(client, kv, uid, 0, 3) == 1
        assert load_one(client, kv, uid, 3, 5, "holder") == []
    finally:
        if stray is not None:
            stray.cancel()
        holder.close()
        other.close()
        client.close()
        region.close()


def test_a_session_with_another_registrations_token_is_refused_and_the_holders_own_token_works(server, uid):
    client = PegaflowClient(server.addr, rpc_timeout_ms=10_000)
    other = PegaflowClient(server.addr, rpc_timeout_ms=10_000)
    region, kv = make_kv(2, 8)
    holder = register(client, kv, uid, "ns-" + uid)
    try:
        assert holder.registration_token and len(holder.registration_token) == 32
        wrong = other.open_session(uid, 0, 0, registration_token="0" * 32)
        ended, _ = _next_event_within(wrong, 10.0)
        assert ended and wrong.error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "is registered by another registration" in wrong.error.details
        assert holder.connected and not holder.superseded
        # The same registration asked again names its token (a holder whose answer was lost).
        with pytest.raises(PegaflowError) as again:
            holder._register_once()
        assert again.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert f"registration token {holder.registration_token}" in again.value.details
    finally:
        holder.close()
        other.close()
        client.close()
        region.close()


def test_an_engine_that_died_before_opening_its_session_frees_the_rank_after_the_grace_period(uid, monkeypatch):
    """The dead engine registered and never opened its session: without a grace period it held
    the rank for good, and the restarted engine was refused "registered by another engine"."""
    from server_proc import ServerProc

    monkeypatch.setenv("PEGAFLOW_SESSION_GRACE_MS", "1500")  # --session-grace-ms
    srv = ServerProc.start()
    client = PegaflowClient(srv.addr, rpc_timeout_ms=10_000, reconnect_max_ms=200)
    dead_region, dead_kv = make_kv(2, 8)
    region, kv = make_kv(2, 8)
    reg = None
    try:
        layers, _ = export_kv_layers(dead_kv)
        client.register_context(
            instance_id=uid, namespace="ns-" + uid, tp_rank=0, tp_size=1,
            layer_names=[l.name for l in layers], region_handles=[l.handle for l in layers],
            geometry=[l.geometry for l in layers],
        )  # ... and the engine dies here, before its session opens
        reg = register(client, kv, uid, "ns-" + uid)  # returns: the rank is retried
        assert not reg.connected and "is registered by another engine" in (reg.last_error or "")
        wait_for(lambda: reg.connected, "registration once the dead engine's rank is reaped")
        assert reg.generation == 1 and not reg.superseded
        time.sleep(2.0)  # past another grace period: a rank with its session is not reaped
        assert reg.connected
        assert save_one(client, kv, uid, 2, 5) == 1
        assert load_one(client, kv, uid, 5, 7, "restarted") == []
    finally:
        if reg is not None:
            reg.close()
        client.close()
        region.close()
        dead_region.close()
        srv.stop()


if __name__ == "__main__":
    {"second": _child, "holder": _holder}[sys.argv[1]](*sys.argv[2:5])


def test_a_first_register_answered_already_exists_counts_as_registered(server, uid):
    """The server still holds these very regions (registered by an earlier registration of
    this process, whose session is not open yet): ALREADY_EXISTS on the first register() is
    "registered", with the token its message names, and the session opens with it."""
    from pegaflow.registration import KvRegistration

    client = PegaflowClient(server.addr, rpc_timeout_ms=5000, reconnect_max_ms=200)
    region, kv = make_kv(2, 8)
    layers, device = export_kv_layers(kv)
    try:
        first = client.register_context(
            instance_id=uid, namespace="ns-" + uid, tp_rank=0, tp_size=1, device_id=device,
            layer_names=[l.name for l in layers], region_handles=[l.handle for l in layers],
            geometry=[l.geometry for l in layers],
        )
        reg = KvRegistration(client, instance_id=uid, namespace="ns-" + uid, layers=layers, device_id=device)
        try:
            reg.register()  # raised ALREADY_EXISTS before
            assert reg.connected and reg.registration_token == first.registration_token
            assert save_one(client, kv, uid, 1, 5) == 1
        finally:
            reg.close()
    finally:
        client.close()
        region.close()
