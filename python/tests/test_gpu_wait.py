"""The GPU-wait watchdog and release rules (pegaflow/gpu_wait.py, load_state.py), without a GPU:
the watchdog thread lets a pending load's waiters go at its deadline and marks it released,
leaves a done load alone, never fires a reused state's old deadline, and the released value
stays cyclically ahead of every layer count (what a stream's "value >= n" compares)."""

from __future__ import annotations

import struct
import time

import pytest

from pegaflow.gpu_wait import GpuWaits
from pegaflow.load_state import RELEASED_LAYERS, STATE_OK, LoadState

LAYERS_READY_OFF, STATE_OFF = 16, 20


def _layers_ready(st: LoadState) -> int:
    return struct.unpack_from("<I", st._mm, LAYERS_READY_OFF)[0]


@pytest.fixture
def watchdog():
    gw = GpuWaits(lib=None, wait_fn=None)  # the watchdog needs no driver
    yield gw
    gw.close()


@pytest.fixture
def state():
    st = LoadState.create()
    yield st
    st.close()


def _eventually(cond, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_a_pending_load_is_released_at_its_deadline_and_its_state_word_left_alone(watchdog, state):
    watchdog.guard(state, time.monotonic() + 0.05)
    assert not state.released
    assert _eventually(lambda: state.released), "the watchdog did not release the load at its deadline"
    assert _layers_ready(state) == RELEASED_LAYERS
    assert state.poll() is None, "the state word is the server's: still pending"


def test_a_load_done_by_its_deadline_is_not_released(watchdog, state):
    struct.pack_into("<Ii", state._mm, LAYERS_READY_OFF, 32, STATE_OK)
    watchdog.guard(state, time.monotonic() + 0.02)
    time.sleep(0.2)
    assert not state.released and _layers_ready(state) == 32


def test_a_reused_state_is_guarded_by_its_new_deadline_only(watchdog, state):
    watchdog.guard(state, time.monotonic() + 0.05)
    watchdog.unguard(state)  # the load settled; the state goes back to the free list
    state.rearm()
    watchdog.guard(state, time.monotonic() + 30.0)  # its next load
    time.sleep(0.3)
    assert not state.released, "the first load's deadline released the second load"
    assert _layers_ready(state) == 0


def test_rearm_clears_released(state):
    state.release_waiters()
    assert state.released
    state.rearm()
    assert not state.released and _layers_ready(state) == 0


@pytest.mark.parametrize("layer", [0, 1, 79, 1023])
def test_the_released_value_is_cyclically_ahead_of_every_layer(layer):
    # CU_STREAM_WAIT_VALUE_GEQ passes when (int32)(value - (layer + 1)) >= 0.
    diff = (RELEASED_LAYERS - (layer + 1)) & 0xFFFFFFFF
    assert diff < 1 << 31
    all_ones = (0xFFFFFFFF - (layer + 1)) & 0xFFFFFFFF
    assert all_ones >= 1 << 31  # why the release is not all ones: it would read as negative


def test_a_release_sticks_until_the_state_is_handed_back(watchdog, state):
    """The server stores each landed layer's count with plain stores: one arriving after the
    deadline's release lowers the word under waits the stream has not reached yet. The
    watchdog writes the released value again until `reap` hands the state back."""

    class Passed:  # the retire event: the stream is past every wait on the state
        def query(self):
            return True

    watchdog.guard(state, time.monotonic() + 0.02)
    assert _eventually(lambda: state.released)
    struct.pack_into("<I", state._mm, LAYERS_READY_OFF, 5)  # a late server's layer 4 landed
    assert _eventually(lambda: _layers_ready(state) == RELEASED_LAYERS), "the release did not stick"
    handed_back = []
    watchdog._retired.append((Passed(), state, handed_back.append))
    watchdog.reap()
    assert handed_back == [state]
    struct.pack_into("<I", state._mm, LAYERS_READY_OFF, 5)
    time.sleep(0.1)
    assert _layers_ready(state) == 5, "a state handed back is the engine's again: never written"


def test_a_release_by_the_worker_sticks_too(watchdog, state):
    watchdog.release(state)
    assert state.released and _layers_ready(state) == RELEASED_LAYERS
    struct.pack_into("<I", state._mm, LAYERS_READY_OFF, 0)  # a late Load's arm zeroes it
    assert _eventually(lambda: _layers_ready(state) == RELEASED_LAYERS)
