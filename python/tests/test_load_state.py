"""Load-state semantics on the engine side: the header it writes, per-layer
waits, failure and timeout. The server's side of the words is simulated by
writing them here (the byte layout is the contract), plus one real refused Load."""

from __future__ import annotations

import os
import struct
import threading

import pytest

from pegaflow.errors import PegaflowError, PegaflowLoadError, PegaflowLoadTimeout
from pegaflow.load_state import LOAD_STATE_BYTES, STATE_REJECTED, LoadState

from leaks import assert_unlinked_at_exit


def publish(st: LoadState, num_layers=None, layers_ready=None, state=None) -> None:
    """Writes the server/native words the way the server does (state before layers_ready)."""
    with open("/dev/shm" + st.name, "r+b") as f:
        if num_layers is not None:
            f.seek(8)
            f.write(struct.pack("<I", num_layers))
        if state is not None:
            f.seek(20)
            f.write(struct.pack("<i", state))
        if layers_ready is not None:
            f.seek(16)
            f.write(struct.pack("<I", layers_ready))


def test_a_new_load_state_holds_the_pfls_header_and_zeroes():
    with LoadState.create() as st:
        raw = open("/dev/shm" + st.name, "rb").read()
        assert len(raw) == LOAD_STATE_BYTES
        assert raw[:4] == b"PFLS" and struct.unpack_from("<I", raw, 4)[0] == 1
        assert raw[8:] == bytes(LOAD_STATE_BYTES - 8)
        publish(st, num_layers=3, layers_ready=3, state=1)
        st.rearm()
        assert tuple(st.snapshot()) == (0, 0, 0)


def test_wait_layer_returns_once_that_layer_landed_and_not_before():
    with LoadState.create() as st:
        publish(st, num_layers=4)
        done = threading.Event()
        t = threading.Thread(target=lambda: (st.wait_layer(2, timeout_s=30), done.set()))
        t.start()
        publish(st, layers_ready=2)  # layers 0 and 1 landed
        st.wait_layer(1, timeout_s=5)
        assert not done.wait(0.2)
        publish(st, layers_ready=3)
        t.join(10)
        assert done.is_set()
        publish(st, state=1, layers_ready=4)
        st.wait_all(timeout_s=5)


def test_a_failed_load_raises_with_its_state_even_when_every_layer_is_marked_done():
    with LoadState.create() as st:
        publish(st, num_layers=4, layers_ready=1)
        publish(st, state=-5, layers_ready=4)  # failure: state first, then layers_ready = num_layers
        with pytest.raises(PegaflowLoadError) as e:
            st.wait_layer(3, timeout_s=5)
        assert e.value.state == -5 and st.name in str(e.value)
        with pytest.raises(PegaflowLoadError):
            st.wait_all(timeout_s=5)
        assert st.poll() is False


def test_a_wait_past_its_deadline_raises_a_timeout_naming_the_layer():
    with LoadState.create() as st:
        publish(st, num_layers=2, layers_ready=1)
        with pytest.raises(PegaflowLoadTimeout, match="layer 1") as e:
            st.wait_layer(1, timeout_s=0.05)
        assert isinstance(e.value, TimeoutError) and e.value.state == 0
        assert st.poll() is None


def test_close_unlinks_the_shm_file():
    st = LoadState.create()
    path = "/dev/shm" + st.name
    assert os.path.exists(path)
    st.close()
    st.close()
    assert not os.path.exists(path)


def test_a_refused_load_fails_the_state_the_engine_waits_on(client, uid):
    from kv_helpers import make_kv, register

    region, kv = make_kv(2, 8)
    reg = register(client, kv, uid, "ns-" + uid)
    try:
        with LoadState.create() as st:
            with pytest.raises(PegaflowError):
                client.load(instance_id=uid, tp_rank=0, lease_id=b"\x00" * 16, block_ids=[1], load_state_shm=st.name)
            with pytest.raises(PegaflowLoadError) as e:
                st.wait_layer(0, timeout_s=5)
            assert e.value.state == STATE_REJECTED
    finally:
        reg.close()
        region.close()


#: An engine process that ends on an unhandled exception without closing its load states (one
#: its own, one handed over to bookkeeping that never ran); a child it forked, exiting normally
#: first, must not take its parent's names with it.
_ENDS_WITHOUT_CLOSING = r"""
import os, sys
from pegaflow.load_state import LoadState
own = LoadState.create()
given = LoadState.create()
given.hand_over()
if os.fork() == 0:
    sys.exit(0)
os.waitpid(-1, 0)
print(own.name, given.name, os.path.exists("/dev/shm" + own.name), os.path.exists("/dev/shm" + given.name), flush=True)
raise RuntimeError("the engine crashed")
"""


def test_load_states_a_process_never_closed_are_unlinked_when_it_exits():
    assert_unlinked_at_exit(_ENDS_WITHOUT_CLOSING, "states", timeout_s=60)
