"""The engine side of the load state: a 64-byte POSIX shm block this
process creates, names in LoadRequest.load_state_shm, and polls for
per-layer progress and the final state without an RPC. Layout (all
little-endian, proto/pegaflow.proto):

    0  u32 magic "PFLS"   4 u32 version 1   8 u32 num_layers (server)
    12 u32 owner (server: whose Load holds the block; `rearm` zeroes it, which frees
       the block for a Load of any instance, e.g. the connector's staging instance)
    16 u32 layers_ready (native: layer i landed once layers_ready > i)
    20 i32 state (0 pending, 1 ok, < 0 failed)

Waiting spins for a short while (a layer usually lands within
microseconds of the previous one) and then sleeps in small steps, so a
waiting thread does not hold the GIL away from the save thread.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import mmap
import os
import struct
import time
from typing import Callable, NamedTuple, Optional

from .errors import PegaflowLoadError, PegaflowLoadTimeout
from . import shm_files

LOAD_STATE_MAGIC = 0x534C4650  # b"PFLS" read as a little-endian u32
LOAD_STATE_VERSION = 1
LOAD_STATE_BYTES = 64
STATE_PENDING = 0
STATE_OK = 1
STATE_REJECTED = -1000
#: Word indexes (u32) of the fields.
_W_NUM_LAYERS, _W_LAYERS_READY, _W_STATE = 2, 4, 5
#: Pure spinning this long before sleeping. It covers the wait for a warm request's first
#: layer (the Load's server side and that layer's copy: 3-6 ms measured on the H100) as
#: well as every later layer's; a backoff sleep there once added up to a millisecond to
#: the first token. An engine's step thread has nothing else to do meanwhile.
SPIN_S = 0.02
#: Sleep steps after the spin: start small, grow to a cap (a slow load
#: costs at most this much extra latency per wait).
SLEEP_MIN_S = 0.00005
SLEEP_MAX_S = 0.0002

#: `layers_ready` of a released block: past every layer, yet within 2^31 of any layer count,
#: because a GPU stream's "value >= n" (CU_STREAM_WAIT_VALUE_GEQ) compares cyclically: all
#: ones would read as -1 there and keep the stream waiting.
RELEASED_LAYERS = 1 << 30

_counter = itertools.count()

def unlink(name: str) -> None:
    """Unlinks a load state's name (every mapping of it stays valid)."""
    shm_files.unlink("/dev/shm" + name)


#: What a wait asks while it sleeps: why no server will write the block any more, or None.
GiveUp = Callable[[], Optional[str]]


class LoadSnapshot(NamedTuple):
    num_layers: int
    layers_ready: int
    state: int


class LoadState:
    """A load-state block created by this process (`create`; reuse it across
    loads with `rearm()`, one per in-flight load) or attached to one another
    process created (`attach`: scheduler-issued loads).

    Example:
        st = LoadState.create()
        st.rearm()
        client.load(..., load_state_shm=st.name)
        st.wait_layer(0, timeout_s=10)   # layer 0 may run now
        st.wait_all(timeout_s=10)        # raises PegaflowLoadError on failure
        st.close()
    """

    def __init__(self, name: str, *, attach: bool = False):
        if not name.startswith("/") or "/" in name[1:] or len(name) >= 64:
            raise ValueError(f"load state name {name!r} must be '/name' (< 64 bytes, no more '/')")
        self.name = name
        path = "/dev/shm" + name
        # The creator unlinks at close (unless it handed the name over); an
        # attacher only unmaps.
        self._path: Optional[str] = None if attach else path
        flags = os.O_RDWR if attach else os.O_RDWR | os.O_CREAT | os.O_EXCL
        fd = os.open(path, flags, 0o600)
        try:
            if attach:
                size = os.fstat(fd).st_size
                if size != LOAD_STATE_BYTES:
                    raise ValueError(f"load state {name}: {size} bytes, expected {LOAD_STATE_BYTES}")
            else:
                os.ftruncate(fd, LOAD_STATE_BYTES)
            self._mm = mmap.mmap(fd, LOAD_STATE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if not attach:
                os.unlink(path)
            raise
        os.close(fd)
        if not attach:
            shm_files.own(path)
        # Set by gpu_wait.GpuWaits.arm: the device address of `layers_ready` (the page
        # registered with CUDA) and what unregisters it at close.
        self.gpu_word: Optional[int] = None
        # Set by release_waiters: a stream may have gone past a layer before it landed, so
        # this load counts as failed even if the server later reports it done.
        self.released = False
        self._gpu_unregister: Optional[Callable[[int], None]] = None
        # Aligned 4-byte loads through a memoryview read the current memory each time.
        self._u32 = memoryview(self._mm).cast("I")
        self._i32 = memoryview(self._mm).cast("i")
        if attach:
            magic, version = struct.unpack_from("<II", self._mm, 0)
            if (magic, version) != (LOAD_STATE_MAGIC, LOAD_STATE_VERSION):
                self.close()
                raise ValueError(
                    f"load state {name}: header {magic:#x} v{version}, expected {LOAD_STATE_MAGIC:#x} "
                    f"v{LOAD_STATE_VERSION}"
                )
        else:
            self.rearm()

    @classmethod
    def create(cls, prefix: str = "pegaflow-ls") -> "LoadState":
        """A fresh block with a unique name."""
        return cls(f"/{prefix}-{os.getpid()}-{next(_counter)}-{os.urandom(3).hex()}")

    @classmethod
    def attach(cls, name: str) -> "LoadState":
        """Maps a block another process created and armed (the scheduler of a
        scheduler-issued load); the creator keeps the name and unlinks it.
        Raises OSError (FileNotFoundError) when the block is gone, ValueError
        when it is not a load state."""
        return cls(name, attach=True)

    def rearm(self) -> None:
        """Writes a fresh header (magic, version, zeroes) for the next Load."""
        self._open()
        self.released = False
        self._mm[:] = b"\0" * LOAD_STATE_BYTES
        struct.pack_into("<II", self._mm, 0, LOAD_STATE_MAGIC, LOAD_STATE_VERSION)

    def host_address(self) -> int:
        """The mapping's address in this process (page-aligned: mmap's)."""
        c = ctypes.c_char.from_buffer(self._mm)
        try:
            return ctypes.addressof(c)
        finally:
            del c  # a live export would make close() fail

    def set_gpu_mapping(self, mapped: int, unregister: Callable[[int], None]) -> None:
        """The block's device mapping (`mapped`: its device address); `unregister(host address)`
        runs at close."""
        self.gpu_word = mapped + 4 * _W_LAYERS_READY
        self._gpu_unregister = unregister

    def release_waiters(self) -> None:
        """Lets every GPU-side wait on this block through (`layers_ready` = RELEASED_LAYERS): a
        load abandoned at its deadline must not leave a stream waiting. Never touches `state`,
        which still tells when the server is done with the block."""
        self.released = True  # before the word: whoever sees the stream let go sees this too
        self._u32[_W_LAYERS_READY] = RELEASED_LAYERS

    def snapshot(self) -> LoadSnapshot:
        self._open()
        return LoadSnapshot(self._u32[_W_NUM_LAYERS], self._u32[_W_LAYERS_READY], self._i32[_W_STATE])

    def mark_failed(self, state: int = STATE_REJECTED) -> None:
        """Marks the load failed from this side (its RPC never reached the server)."""
        self._open()
        self._i32[_W_STATE] = state

    def _open(self) -> None:
        """Raises ValueError naming the block when it was closed (its words are gone)."""
        if self._mm.closed:
            raise ValueError(f"load state {self.name} is closed")

    def _wait(self, layer: Optional[int], timeout_s: float, give_up: Optional[GiveUp] = None) -> int:
        self._open()
        if layer is not None and (not hasattr(layer, "__index__") or layer < 0):
            # A negative index compares below any layers_ready: it read as landed at once.
            raise ValueError(f"load state {self.name}: layer {layer!r} is not a layer index (>= 0)")
        if math.isnan(timeout_s):
            # NaN compares false against every deadline: the wait never ended.
            raise ValueError(f"load state {self.name}: timeout {timeout_s!r} is not a number of seconds")
        u32, i32 = self._u32, self._i32
        start = time.monotonic()
        deadline = start + timeout_s
        sleep = SLEEP_MIN_S
        while True:
            # state first: a failed load may also publish layers_ready = num_layers.
            state = i32[_W_STATE]
            if state != STATE_PENDING:
                break
            if layer is not None and u32[_W_LAYERS_READY] > layer:
                state = i32[_W_STATE]
                break
            now = time.monotonic()
            if now >= deadline:
                what = "the load" if layer is None else f"layer {layer}"
                raise PegaflowLoadTimeout(
                    f"load state {self.name}: {what} not done after {timeout_s:.3f} s "
                    f"(layers_ready {u32[_W_LAYERS_READY]}/{u32[_W_NUM_LAYERS]})"
                )
            if now - start < SPIN_S:
                os.sched_yield()
                continue
            why = give_up() if give_up is not None else None
            if why:
                what = "the load" if layer is None else f"layer {layer}"
                raise PegaflowLoadTimeout(
                    f"load state {self.name}: stopped waiting for {what} after {now - start:.3f} s: {why} "
                    f"(layers_ready {u32[_W_LAYERS_READY]}/{u32[_W_NUM_LAYERS]})"
                )
            time.sleep(sleep)
            sleep = min(sleep * 2, SLEEP_MAX_S)
        if state < 0:
            snap = self.snapshot()
            raise PegaflowLoadError(
                state,
                f"load state {self.name}: load failed with state {state} "
                f"(layers_ready {snap.layers_ready}/{snap.num_layers}); recompute its blocks",
            )
        return state

    def wait_layer(self, layer: int, timeout_s: float, give_up: Optional[GiveUp] = None) -> None:
        """Returns once layer `layer` (registration order) has landed; raises
        PegaflowLoadError if the load failed, PegaflowLoadTimeout past the deadline.
        `give_up()`, asked while the wait sleeps (past its first SPIN_S), says why no server
        will write this block any more (e.g. the session of the rank that sent the Load ended):
        a reason ends the wait at once with PegaflowLoadTimeout (the load may still land, as
        after a deadline, if its server is alive)."""
        self._wait(layer, timeout_s, give_up)

    def wait_all(self, timeout_s: float, give_up: Optional[GiveUp] = None) -> None:
        """Returns once every layer landed (state ok); raises as `wait_layer`."""
        self._wait(None, timeout_s, give_up)

    def poll(self) -> Optional[bool]:
        """Non-blocking: None while pending, True when ok, False when failed."""
        self._open()
        s = self._i32[_W_STATE]
        return None if s == STATE_PENDING else s > 0

    @property
    def state(self) -> int:
        self._open()
        return self._i32[_W_STATE]

    def hand_over(self) -> None:
        """The name is unlinked elsewhere (the creator's bookkeeping outlives
        this mapping): a later `close` only unmaps."""
        self._path = None

    def close(self) -> None:
        """Unmaps the block and, if this process created it, unlinks it (the
        server holds its own mapping while a copy runs, so this is safe at any
        time)."""
        if self._mm.closed:
            return
        if self._gpu_unregister is not None:
            self._gpu_unregister(self.host_address())
            self._gpu_unregister, self.gpu_word = None, None
        self._u32.release()
        self._i32.release()
        self._mm.close()
        if self._path is None:
            return
        unlink(self.name)

    def __enter__(self) -> "LoadState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
