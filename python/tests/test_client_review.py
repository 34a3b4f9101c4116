"""Edges of the client package an engine runs into: settings gRPC cannot take, a call racing
close(), close() while a re-registration is in flight, a server restarted between RegisterContext
and Session, load-state waits given bad arguments or used after close, shm files on a failed
allocation, and block hashes from bytes-like parents, numpy tokens and the native switch."""

from __future__ import annotations

import math
import os
import threading

import grpc
import numpy as np
import pytest

from pegaflow.client import PegaflowClient
from pegaflow.config import ClientConfig
from pegaflow.errors import PegaflowError
from pegaflow.hashes import chain_hashes, root_hash
from pegaflow.load_state import LoadState
from pegaflow.regions import ShmRegion


# ---- config ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["PEGAFLOW_KEEPALIVE_MS", "PEGAFLOW_RECONNECT_MAX_MS", "PEGAFLOW_RPC_TIMEOUT_MS"])
def test_a_millisecond_setting_past_what_grpc_takes_is_refused_naming_the_variable(name):
    # gRPC's channel arguments are C ints: 3e9 ms used to be accepted here and then made every
    # call raise OverflowError (not a PegaflowError) into the engine.
    with pytest.raises(ValueError, match=name):
        ClientConfig.resolve(env={name: "3000000000"})
    with pytest.raises(ValueError, match=name[len("PEGAFLOW_"):].lower()):
        ClientConfig.resolve(**{name[len("PEGAFLOW_"):].lower(): 3_000_000_000}, env={})


def test_a_bad_address_from_the_environment_names_the_variable():
    with pytest.raises(ValueError, match="PEGAFLOW_ADDR"):
        ClientConfig.resolve(env={"PEGAFLOW_ADDR": "localhost"})


def test_a_constructor_setting_that_is_not_a_number_names_the_setting():
    with pytest.raises(ValueError, match="rpc_timeout_ms"):
        ClientConfig.resolve(rpc_timeout_ms="soon", env={})


# ---- close() racing calls ---------------------------------------------------


@pytest.fixture
def closing_client():
    """A client whose next stub look-up is followed by close(): the call then runs on a channel
    closed under it (another thread's close() between the look-up and the invocation)."""
    c = PegaflowClient("127.0.0.1:1", rpc_timeout_ms=1000)
    real = c._stub

    def stub_then_close(*a, **kw):
        s = real(*a, **kw)
        c.close()
        return s

    c._stub = stub_then_close
    yield c
    c.close()


def test_a_unary_call_racing_close_raises_cancelled(closing_client):
    with pytest.raises(PegaflowError) as e:
        closing_client.health()
    assert e.value.code == grpc.StatusCode.CANCELLED and e.value.method == "Health"


def test_a_session_opened_racing_close_raises_cancelled(closing_client):
    with pytest.raises(PegaflowError) as e:
        closing_client.open_session("inst", 0)
    assert e.value.code == grpc.StatusCode.CANCELLED and e.value.method == "Session"


def test_a_nowait_call_racing_close_raises_cancelled(closing_client):
    with pytest.raises(PegaflowError) as e:
        closing_client.release_nowait(b"\x00" * 16, lambda err: None)
    assert e.value.code == grpc.StatusCode.CANCELLED and e.value.method == "Release"


# ---- registration -------------------------------------------------------------


def test_close_while_a_re_registration_is_in_flight_leaves_no_instance_on_the_server(client, uid):
    """close() during a reconnect finds the rank not connected, so it unregisters nothing; a
    RegisterContext already on its way then lands, and no session would ever end it: the server
    kept the instance (and its mapped regions) for good."""
    from kv_helpers import make_kv, register

    region, kv = make_kv(1, 8)
    own = PegaflowClient(client.address, reconnect_max_ms=200)
    reg = register(own, kv, uid, "ns-" + uid)
    real = own.register_context

    def close_then_register(**kw):
        reg.close()  # the engine shuts down while the watcher re-registers
        return real(**kw)

    own.register_context = close_then_register
    try:
        assert client.unregister_context(uid) == 0  # CLEANED_UP: the watcher re-registers
        reg._thread.join(10)
        assert not reg._thread.is_alive()
        assert not reg.connected
        with pytest.raises(PegaflowError) as e:
            client.query_prefetch(instance_id=uid, block_hashes=[b"\x01" * 16], request_id="q")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "is not registered" in e.value.details
    finally:
        own.register_context = real
        try:
            client.unregister_context(uid)
        except PegaflowError:
            pass
        own.close()
        region.close()


def test_a_server_restarted_between_register_and_session_still_ends_up_holding_the_rank(uid):
    """RegisterContext answered by the old server, the Session taken by its successor at the same
    address (which never saw the registration and takes a session for any instance): the rank
    read connected while every call failed "not registered" until the next restart."""
    import time

    from kv_helpers import make_kv, register, save_one
    from server_proc import ServerProc

    servers = [ServerProc.start()]
    addr = servers[0].addr
    region, kv = make_kv(1, 8)
    c = PegaflowClient(addr, rpc_timeout_ms=2000, reconnect_max_ms=200)
    reg = register(c, kv, uid, "ns-" + uid)
    real = c.register_context
    armed = [True]
    last = None

    def register_then_restart(**kw):
        r = real(**kw)
        if armed[0]:
            armed[0] = False
            servers[-1].kill()
            servers.append(ServerProc.start(addr))  # up before the session is opened
        return r

    c.register_context = register_then_restart
    try:
        c.unregister_context(uid)  # CLEANED_UP: the watcher registers again, and the server restarts
        end = time.monotonic() + 20
        while True:
            try:
                if reg.connected and save_one(c, kv, uid, 3, 7) == 1:
                    break
            except PegaflowError as e:
                last = e
            assert time.monotonic() < end, f"the rank never registered on the new server: {last}"
            time.sleep(0.05)
    finally:
        c.register_context = real
        reg.close()
        c.close()
        region.close()
        for s in servers:
            s.stop()


# ---- load state -----------------------------------------------------------------


def test_a_negative_layer_is_refused_not_reported_landed():
    with LoadState.create() as st:
        with pytest.raises(ValueError, match=f"{st.name}.*layer -1"):
            st.wait_layer(-1, timeout_s=0.01)


def test_a_nan_timeout_is_refused_instead_of_waiting_for_ever():
    with LoadState.create() as st:
        result = []
        t = threading.Thread(target=lambda: result.append(_raises(lambda: st.wait_all(math.nan))), daemon=True)
        t.start()
        t.join(2)
        assert not t.is_alive(), "wait_all(nan) never returns"
        assert isinstance(result[0], ValueError) and "timeout" in str(result[0])


def _raises(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001 - the test looks at what was raised
        return e
    return None


def test_using_a_closed_load_state_names_it():
    st = LoadState.create()
    st.close()
    for use in (lambda: st.wait_layer(0, 1.0), lambda: st.wait_all(1.0), st.poll, st.snapshot, st.rearm):
        with pytest.raises(ValueError, match=f"load state {st.name} is closed"):
            use()


# ---- shm regions ----------------------------------------------------------------


def _my_shm() -> list:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"pegaflow-kv-{os.getpid()}-"))


def test_a_region_for_a_shape_that_cannot_be_viewed_leaves_no_shm_file():
    before = _my_shm()
    with pytest.raises(ValueError, match="dimension"):
        ShmRegion.holding(np.zeros(1, np.float16), (-2, -3))  # 6 elements, no such view
    with pytest.raises(ValueError):
        ShmRegion.holding(np.array([None]), (4,))  # object arrays cannot live in a buffer
    assert _my_shm() == before


# ---- hashes ---------------------------------------------------------------------


def test_a_bytes_like_parent_hash_chains_like_bytes():
    parent = root_hash("review")
    want = chain_hashes(parent, list(range(32)), 16)
    assert chain_hashes(bytearray(parent), list(range(32)), 16) == want
    assert chain_hashes(memoryview(parent), list(range(32)), 16) == want


@pytest.mark.parametrize("off", ["0", "off", "false", "no"])
def test_native_hashes_can_be_turned_off_with_any_boolean_spelling(monkeypatch, off):
    from pegaflow import native

    monkeypatch.setenv("PEGAFLOW_NATIVE_HASH", off)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    assert native.hash_impl() == "hashlib"


def test_a_native_hash_setting_that_is_no_boolean_names_the_variable(monkeypatch):
    from pegaflow import native

    monkeypatch.setenv("PEGAFLOW_NATIVE_HASH", "maybe")
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    with pytest.raises(ValueError, match="PEGAFLOW_NATIVE_HASH"):
        native.hash_impl()


def test_a_numpy_token_outside_u32_is_named_not_the_first_token():
    with pytest.raises(ValueError, match="token id -3 is not a u32"):
        chain_hashes(root_hash(), np.array([1, 2, -3, 4]), 2)
