"""Staging blocks for layer-wise loads: the server copies a load into a contiguous run of
blocks of a staging KV cache that this rank owns (registered as a second instance,
`<instance>.staging`, in the same namespace), and `wait_for_layer_load` scatters each layer
from there into the request's own blocks on the engine's stream.

Why: an engine hands a request whatever blocks its free queue yields; vLLM frees a request's
blocks in reverse order, so a re-sent prompt gets descending block ids, and then none of a
load's ranges merge: 40,896 ranges of 32 KB for a 10K-token Llama-3.1-8B prefix. A load
runs on one DMA stream (its layers must land in order) and one thread issues ~1.3 M copy
descriptors/s, so such a load took 33-45 ms on the H100 against 24.7 ms for contiguous
targets. Into staging blocks 0..n-1 the ranges merge (one per layer and K/V plane) and the
copy runs at the link's rate whatever the targets; the scatter is a device-local copy
(~84 MB a layer at HBM speed). The price is the staging memory: `blocks` blocks of every
layer, i.e. the largest prefix one step loads.

The scheduler side hands out staging blocks per step (`StagingRoom`); a step's loads end
with the step in layer-wise mode, so every step starts with all of them free.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from pegaflow.regions import ShmRegion, block_axis

__all__ = ["STAGING_SUFFIX", "StagingBuffers", "StagingRoom", "staging_instance"]

STAGING_SUFFIX = ".staging"


def staging_instance(instance_id: str) -> str:
    """The instance id a rank's staging blocks are registered under (within the server's
    128-character name limit: a long id keeps a prefix and a digest of the whole)."""
    if len(instance_id) + len(STAGING_SUFFIX) <= 128:
        return instance_id + STAGING_SUFFIX
    digest = hashlib.sha256(instance_id.encode()).hexdigest()[:16]
    return instance_id[: 128 - len(STAGING_SUFFIX) - 17] + "-" + digest + STAGING_SUFFIX


class StagingRoom:
    """Scheduler side: the staging blocks. A probe reserves its hits (the engine may allocate
    them later in the step) and an allocation takes a contiguous run that is free again at the
    next step. A held run (load_issuer "query": its copy starts at the probe, before the
    engine allocates) outlives steps until it is claimed by the step that loads it, or
    released once its copy settled. New runs go above every held one (a held run is rare and
    short-lived; the room does not fill holes below it).

    Example:
        room = StagingRoom(1024)
        n = room.offer(639)          # 639: a probe may report up to this many hits
        room.reserve(n); first = room.take(n, reserved=n)   # 0
        room.next_step()
        first = room.hold("req-7", 639); room.shrink("req-7", 600); room.claim("req-7")
    """

    def __init__(self, blocks: int):
        if blocks < 0:
            raise ValueError(f"staging blocks must be >= 0, got {blocks}")
        self.blocks = blocks
        self._taken = 0
        self._reserved = 0
        self._held: Dict[Any, Tuple[int, int]] = {}

    def _floor(self) -> int:
        """First block above this step's runs and every held run."""
        top = self._taken
        for first, n in self._held.values():
            top = max(top, first + n)
        return top

    def offer(self, wanted: int) -> int:
        """How many of `wanted` blocks a new probe may report as hits."""
        return max(0, min(wanted, self.blocks - self._floor() - self._reserved))

    def reserve(self, n: int) -> None:
        self._reserved += n

    def unreserve(self, n: int) -> None:
        self._reserved = max(0, self._reserved - n)

    def take(self, n: int, reserved: int) -> int:
        """First block of a run of `n` for an allocation whose probe reserved `reserved`."""
        self.unreserve(reserved)
        first = self._fit(n)
        self._taken = first + n
        return first

    def _fit(self, n: int) -> int:
        first = self._floor()
        if first + n > self.blocks:
            raise ValueError(f"staging: {n} blocks asked, {self.blocks - first} free")
        return first

    def hold(self, key: Any, n: int) -> int:
        """First block of a run of `n` held under `key` across steps."""
        if key in self._held:
            raise ValueError(f"staging: a run is already held for {key!r}")
        first = self._fit(n)
        self._held[key] = (first, n)
        return first

    def shrink(self, key: Any, n: int) -> None:
        """Keeps only the first `n` blocks of `key`'s run (0: gives it all back)."""
        first, had = self._held.pop(key)
        if 0 < n <= had:
            self._held[key] = (first, n)

    def claim(self, key: Any, keep_as: Any = None) -> Tuple[int, int]:
        """`key`'s held run becomes a run of the step being built: (first, n). With `keep_as`
        it also stays held, under that key, until released (a copy into it may outlive the step)."""
        first, n = self._held.pop(key)
        self._taken = max(self._taken, first + n)
        if keep_as is not None:
            self._held[keep_as] = (first, n)
        return first, n

    def rekey(self, key: Any, new_key: Any) -> None:
        """`key`'s held run, held from now on under `new_key`."""
        self._held[new_key] = self._held.pop(key)

    def release(self, key: Any) -> None:
        """Gives `key`'s held run back (its copy settled, or never started)."""
        self._held.pop(key, None)

    @property
    def held(self) -> int:
        return len(self._held)

    def next_step(self) -> None:
        """The step was built: its loads own their runs until it ends; the next step starts with
        only the held runs taken."""
        self._taken = 0


class StagingBuffers:
    """Worker side: one staging tensor per KV layer, shaped like that layer with `blocks` blocks
    (same dtype and device; on the host backend inside a shared-memory file the server maps).

    Example:
        st = StagingBuffers(kv_caches, 1024)
        st.scatter("model.layers.0.self_attn", first=0, index=st.index([7, 3, 9]))
    """

    def __init__(self, kv_caches: Mapping[str, Any], blocks: int, layout: Optional[str] = None):
        if blocks < 1:
            raise ValueError(f"staging blocks must be >= 1, got {blocks}")
        self.blocks = blocks
        self._kv: Dict[str, Any] = dict(kv_caches)
        self.tensors: Dict[str, Any] = {}
        self._axis: Dict[str, int] = {}
        self._regions: List[ShmRegion] = []
        self._index: Dict[str, Any] = {}
        try:
            for name, t in self._kv.items():
                ax = block_axis(list(t.shape), layout)
                shape = list(t.shape)
                shape[ax] = blocks
                self._axis[name] = ax
                self.tensors[name] = self._alloc(t, shape)
        except BaseException:
            self.close()  # nobody gets this object to close: the regions made so far go now
            raise

    def _alloc(self, like: Any, shape: Sequence[int]) -> Any:
        if getattr(like, "is_cuda", False):
            import torch

            return torch.empty(shape, dtype=like.dtype, device=like.device)
        r, t = ShmRegion.holding(like, shape)
        self._regions.append(r)
        return t

    def index(self, block_ids: Sequence[int]) -> Any:
        """`block_ids` as the index `scatter` takes (made once per load, used by every layer)."""
        some = next(iter(self._kv.values()))
        if isinstance(some, np.ndarray):
            return np.asarray(block_ids, dtype=np.int64)
        import torch

        return torch.as_tensor(list(block_ids), dtype=torch.long).to(some.device)

    def scatter(self, name: str, first: int, index: Any) -> None:
        """Copies staging blocks [first, first + len(index)) of layer `name` into its KV blocks
        `index` (from `index()`; on the tensor's device, for CUDA on the current stream, so
        the layer's attention, issued after it, sees them)."""
        dst, src, ax = self._kv[name], self.tensors[name], self._axis[name]
        n = len(index)
        if isinstance(dst, np.ndarray):
            sl = [slice(None)] * dst.ndim
            sl_src = list(sl)
            sl[ax] = index
            sl_src[ax] = slice(first, first + n)
            dst[tuple(sl)] = src[tuple(sl_src)]
            return
        dst.index_copy_(ax, index, src.narrow(ax, first, n))

    def close(self) -> None:
        self.tensors.clear()
        for r in self._regions:
            r.close()
        self._regions = []
