"""GPU-side waits on a load state's progress word (layer-wise loads on CUDA).

A host-side `wait_for_layer_load` blocks the engine's thread until layer i has
landed, so every layer's kernels are launched only after its bytes arrived,
and the last layer's launches, the LM head and the sampling all start from the
host after the last copy: ~0.5 ms of host work on a warm request's critical
path (measured on the H100, docs/minivllm.md). Here the wait is enqueued on
the engine's CUDA stream instead (`cuStreamWaitValue32` on the load state's
`layers_ready` word, the shm page registered with `cuMemHostRegister` and read
by the GPU through its device mapping): `wait_for_layer_load` returns at once,
the host launches the whole forward ahead, and layer i's kernels start on the
GPU as soon as the server's completion thread writes `layers_ready > i`.

The deadline stays on the host, twice: the worker waits for the whole load
(with the load timeout) before the step's sampling, and a load that did not
finish in time is released (`LoadState.release_waiters`: `layers_ready` past every
layer) so that no stream waits forever on a dead server; its blocks are
recomputed. And a watchdog thread (`guard`) releases a load at its deadline on
its own: the engine's thread may be blocked inside a kernel launch behind the
wait (CUDA's lazy module loading synchronizes the context when a kernel is
launched for the first time), where it could never release it.

A registered state must stay mapped and registered until the stream has
passed every wait on it: `retire` records an event after the step's waits and
`reap` unregisters (and hands the state back) only once that event completed.
A state closed for good (`close_later`) is unregistered only while the stream
is idle (`close_idle`, at the next step's start): `cuMemHostUnregister` waits
for the device to drain — 0.05 ms idle, 64 ms behind queued work on an H200 —
and a close at the end of a warm step's forward held its host until the last
layer and whatever followed it had run (~0.5 ms before its first token).

A release must also stick until then: the server writes each landed layer's
count (and zero when it accepts a Load) with plain stores, so a late server
could lower the released word under a wait the stream has not reached yet, and
if it then died, that wait would never pass. Until `reap` hands a released
state back, the watchdog writes the released value again every
`RELEASE_REASSERT_S`.

Example:
    gw = GpuWaits.open()            # None where the driver cannot (CPU, old driver)
    gw.arm(state)                    # once per state (cached)
    gw.wait(state, layer)            # on torch's current stream
    gw.retire(state, then=free.append)
    gw.reap()                        # later: unregisters what the GPU is done with
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .cuda_ipc import CUDA_SUCCESS, CudaIpcError, _drv
from .load_state import LOAD_STATE_BYTES, LoadState

log = logging.getLogger("pegaflow.gpu_wait")

CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_STREAM_WAIT_VALUE_GEQ = 0x0
#: How often a released state's word is written again until the stream is past its waits.
RELEASE_REASSERT_S = 0.01
#: States `close_later` keeps for an idle stream, at most: past it `close_kept` closes them anyway.
MAX_DEFERRED_CLOSES = 64


_stream_getter: Optional[Callable[[], int]] = None


def _current_stream() -> int:
    """torch's current CUDA stream on the current device, as the driver's handle (an int).

    Called once per layer of a loading step: torch's raw getter takes ~0.1 us where
    `torch.cuda.current_stream()` builds a Stream object (~9 us on the H100 host)."""
    global _stream_getter
    if _stream_getter is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        current_device = torch.cuda.current_device
        if raw is not None:
            _stream_getter = lambda: raw(current_device())  # noqa: E731
        else:  # an older torch: the public way
            _stream_getter = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    return _stream_getter()


class GpuWaits:
    """The driver calls and the registered states of one worker (one thread: the engine's)."""

    def __init__(self, lib: Any, wait_fn: Any) -> None:
        self._lib = lib
        self._wait = wait_fn
        # (event after the last wait on the state, the state, what to do with it afterwards)
        self._retired: List[Tuple[Any, LoadState, Callable[[LoadState], None]]] = []
        # States the GPU is done with, to close (unregister) once the stream is idle.
        self._to_close: List[LoadState] = []
        # The watchdog: (deadline, guard token, state) of loads a stream may wait on; a state
        # is guarded by its latest token only (a reused state's old deadline must not fire).
        self._cv = threading.Condition()
        self._deadlines: List[Tuple[float, int, LoadState]] = []
        self._guarded: Dict[int, int] = {}
        self._seq = itertools.count()
        # Released states whose waits the stream may not have passed yet: their word is
        # written again every RELEASE_REASSERT_S until `reap` hands them back.
        self._released: Dict[int, LoadState] = {}
        self._watchdog: Optional[threading.Thread] = None
        self._stop = False

    @classmethod
    def open(cls) -> Optional["GpuWaits"]:
        """The driver's stream memory operations, or None (logged) where they are missing."""
        try:
            lib = _drv().lib
        except CudaIpcError as e:
            log.warning("GPU-side layer waits off (host waits instead): %s", e)
            return None
        wait_fn = None
        for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
            wait_fn = getattr(lib, name, None)
            if wait_fn is not None:
                break
        if wait_fn is None:
            log.warning("GPU-side layer waits off (host waits instead): libcuda has no cuStreamWaitValue32")
            return None
        wait_fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        return cls(lib, wait_fn)

    def arm(self, st: LoadState) -> bool:
        """Registers the state's page for the GPU (once per state); False (logged) if the driver refuses."""
        if st.gpu_word is not None:
            return True
        addr = st.host_address()
        rc = self._lib.cuMemHostRegister_v2(addr, LOAD_STATE_BYTES, CU_MEMHOSTREGISTER_DEVICEMAP)
        if rc != CUDA_SUCCESS:
            log.warning("load state %s: cuMemHostRegister failed (%s): host waits for this load", st.name, _drv().err(rc))
            return False
        dptr = ctypes.c_uint64()
        rc = self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), addr, 0)
        if rc != CUDA_SUCCESS:
            self._lib.cuMemHostUnregister(addr)
            log.warning("load state %s: cuMemHostGetDevicePointer failed (%s): host waits for this load",
                        st.name, _drv().err(rc))
            return False
        st.set_gpu_mapping(dptr.value, self._unregister)
        return True

    def _unregister(self, addr: int) -> None:
        rc = self._lib.cuMemHostUnregister(addr)
        if rc != CUDA_SUCCESS:
            log.warning("cuMemHostUnregister(0x%x) failed: %s", addr, _drv().err(rc))

    def wait(self, st: LoadState, layer: int) -> bool:
        """Enqueues "layers_ready > layer" on torch's current stream; False if the driver refused
        (the caller then waits on the host)."""
        rc = self._wait(_current_stream(), st.gpu_word, layer + 1, CU_STREAM_WAIT_VALUE_GEQ)
        if rc != CUDA_SUCCESS:
            log.warning("load state %s: cuStreamWaitValue32 failed (%s): host waits", st.name, _drv().err(rc))
            return False
        return True

    def release(self, st: LoadState) -> None:
        """Lets every wait on `st` through, and keeps it so until `reap` hands it back."""
        with self._cv:
            self._release_locked(st)
            self._start_watchdog()
            self._cv.notify()

    def _release_locked(self, st: LoadState) -> None:
        """Lets `st`'s waits through and keeps re-asserting it until `reap` (under `_cv`)."""
        st.release_waiters()
        self._released[id(st)] = st

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="pegaflow-gpu-wait-watchdog", daemon=True)
            self._watchdog.start()

    def guard(self, st: LoadState, deadline: float) -> None:
        """Releases `st`'s waiters at `deadline` (time.monotonic()) if its load is still
        pending then, from the watchdog thread, whatever the engine's thread is doing."""
        with self._cv:
            token = next(self._seq)
            self._guarded[id(st)] = token
            heapq.heappush(self._deadlines, (deadline, token, st))
            self._start_watchdog()
            self._cv.notify()

    def unguard(self, st: LoadState) -> None:
        """The state leaves the watchdog (before it is reused or closed)."""
        with self._cv:
            self._guarded.pop(id(st), None)

    def _current(self, token: int, st: LoadState) -> bool:
        return self._guarded.get(id(st)) == token

    def _watch(self) -> None:
        with self._cv:
            while not self._stop:
                now = time.monotonic()
                while self._deadlines and (
                    self._deadlines[0][0] <= now or not self._current(self._deadlines[0][1], self._deadlines[0][2])
                ):
                    _, token, st = heapq.heappop(self._deadlines)
                    if self._current(token, st):
                        del self._guarded[id(st)]
                        if st.poll() is None:
                            log.warning("load state %s: load not done at its deadline; GPU waits on it released",
                                        st.name)
                            self._release_locked(st)
                wait = self._deadlines[0][0] - now if self._deadlines else None
                if self._released:
                    for st in self._released.values():
                        st.release_waiters()  # a late server may have lowered it
                    wait = RELEASE_REASSERT_S if wait is None else min(wait, RELEASE_REASSERT_S)
                self._cv.wait(wait)

    def close(self) -> None:
        """Closes what `close_later` kept and stops the watchdog (after the states were released
        and reaped)."""
        self.close_idle(force=True)
        with self._cv:
            self._stop = True
            self._released.clear()  # the states are closed next: never written again
            self._cv.notify()
        if self._watchdog is not None:
            self._watchdog.join(1.0)

    def retire(self, st: LoadState, then: Callable[[LoadState], None]) -> None:
        """`then(st)` once the current stream has passed every wait enqueued so far."""
        import torch

        self.unguard(st)
        ev = torch.cuda.Event()
        ev.record()
        self._retired.append((ev, st, then))

    def reap(self, block: bool = False) -> None:
        """Runs `then` for the retired states the GPU is done with (all of them when `block`)."""
        keep = []
        for ev, st, then in self._retired:
            if block:
                st.release_waiters()  # nothing may keep the stream waiting at shutdown
                ev.synchronize()
            elif not ev.query():
                keep.append((ev, st, then))
                continue
            with self._cv:
                self._released.pop(id(st), None)  # past its waits: `then` may close it
            then(st)
        self._retired = keep

    def close_later(self, st: LoadState) -> None:
        """Closes `st` (a state the GPU no longer waits on: give it to `retire` as `then`) at the
        next `close_idle` that finds the stream idle: unregistering its page waits for the device
        to drain, which would hold the engine's host behind the step's queued kernels."""
        self._to_close.append(st)

    def close_kept(self) -> None:
        """At a step's start (before it launches anything): the kept states close if the stream
        is idle, or at once past MAX_DEFERRED_CLOSES (a stream never idle there, as under an
        engine that schedules ahead: their unregister then waits for the previous step's work,
        once every MAX_DEFERRED_CLOSES loads, never inside a step's forward)."""
        self.close_idle(force=len(self._to_close) > MAX_DEFERRED_CLOSES)

    def close_idle(self, force: bool = False) -> None:
        """Closes the states `close_later` kept, if the current stream is idle (or `force`).

        Never raises: a state whose close fails (its unmap or unlink) is logged and dropped,
        and the rest are still closed. Raising here would leave them mapped and registered
        for good, stop `close` before its watchdog (and the worker's close before its other
        states), and, from `reap`, whose `then` this runs in, hand its earlier states back
        a second time at the next `reap` (one state given to two loads)."""
        if not self._to_close:
            return
        if not force:
            import torch

            if not torch.cuda.current_stream().query():
                return
        closing, self._to_close = self._to_close, []
        for st in closing:
            try:
                st.close()
            except Exception as e:  # noqa: BLE001 - one state's close must not keep the others mapped
                log.warning("load state %s: close failed (%s: %s); dropped, the others still close",
                            st.name, type(e).__name__, e)

    @property
    def retired(self) -> int:
        return len(self._retired)

    @property
    def closing(self) -> int:
        """States kept by `close_later`, not closed yet."""
        return len(self._to_close)
