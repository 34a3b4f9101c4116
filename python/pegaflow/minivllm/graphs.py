"""CUDA graphs of a small step's dense layer halves (vLLM's piecewise CUDA graphs, in small).

A step of a few tokens (a prefix hit's last block, a decode batch) is launch-bound in eager
PyTorch: ~27 torch calls a layer at ~10-40 us of CPU each, so the GPU waits for the host and
a busy host slows the step. vLLM captures everything but the attention as CUDA graphs, for a
set of padded token counts. This does the same per layer: `pre` (norm, fused QKV, RoPE) and
`post` (o-proj, norm, MLP, both residual adds) are each one graph; the attention (K/V into the
paged cache, the gather, SDPA) and the connector hooks around it stay eager, so
`wait_for_layer_load(i)` still gates layer i's attention exactly where vLLM calls it.

Graphs are captured the first time a padded size is used (`SIZES`; ~65 graphs, a fraction of a
second), with static inputs (token ids, positions), a static residual stream `x` and a static
attention output. Rows past the step's real tokens compute on stale but finite values: every
captured op is row-wise (GEMMs, norms, RoPE), and the eager attention reads only the real rows,
so padding never reaches a real token. One memory pool per size; the graphs of a size are
replayed in the order they were captured (prologue, then pre/post of each layer).

    model = LlamaModel(CONFIGS["llama-3.1-8b"], "cuda")   # model.graphs: StepGraphs
    hidden = model.forward(batch, kv_caches)              # replays graphs for ≤ 512 tokens
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from pegaflow.minivllm.llama import LlamaModel

__all__ = ["MAX_GRAPH_TOKENS", "SIZES", "SizeGraphs", "StepGraphs"]

log = logging.getLogger(__name__)

#: Padded token counts a step is captured at (vLLM's capture sizes, shortened).
SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
#: Steps with more tokens run eagerly (a prefill is GPU-bound; graphs would buy nothing).
MAX_GRAPH_TOKENS = SIZES[-1]


class SizeGraphs:
    """The graphs and static buffers of one padded size."""

    def __init__(self, model: LlamaModel, size: int) -> None:
        cfg, dev = model.cfg, model.device
        self.model, self.size = model, size
        self.ids = torch.zeros(size, dtype=torch.long, device=dev)
        self.pos = torch.zeros(size, dtype=torch.long, device=dev)
        self.x = torch.zeros(size, cfg.hidden_size, dtype=cfg.torch_dtype, device=dev)
        self.attn = torch.zeros(size, model.q_heads * cfg.head_dim, dtype=cfg.torch_dtype, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.prologue = torch.cuda.CUDAGraph()
        self.pre: list[torch.cuda.CUDAGraph] = []
        self.post: list[torch.cuda.CUDAGraph] = []
        self._capture()

    def _prologue(self) -> None:
        self.x.copy_(self.model.embed[self.ids])
        self.rope = self.model._rope(self.pos)

    def _capture(self) -> None:
        m = self.model
        # Warm up on a side stream first (cuBLAS picks and allocates its workspaces there,
        # outside any capture), as torch's CUDA-graph notes ask.
        side = torch.cuda.Stream(device=m.device)
        side.wait_stream(torch.cuda.current_stream(m.device))
        with torch.cuda.stream(side):
            self._prologue()
            cos, sin = self.rope  # type: ignore[misc]
            for w in m._fw:
                m._pre_attention(w, self.x, cos, sin)
                m._post_attention(w, self.x, self.attn)
        torch.cuda.current_stream(m.device).wait_stream(side)
        torch.cuda.synchronize(m.device)
        # Captured on the warmed stream; thread_local: the connector's save thread may touch
        # CUDA while this captures.
        kw: dict[str, Any] = {"pool": self.pool, "stream": side, "capture_error_mode": "thread_local"}
        with torch.cuda.graph(self.prologue, **kw):
            self._prologue()
        cos, sin = self.rope  # type: ignore[misc]
        for w in m._fw:
            pre, post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(pre, **kw):
                out = m._pre_attention(w, self.x, cos, sin)
            with torch.cuda.graph(post, **kw):
                m._post_attention(w, self.x, self.attn)
            self.pre.append(pre)
            self.post.append(post)
            self.qkv.append(out)
        torch.cuda.synchronize(m.device)

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Loads the step's tokens and runs the prologue (embedding, RoPE tables); returns the
        static residual stream (all `size` rows; the first len(input_ids) are the step's)."""
        t = input_ids.shape[0]
        self.ids[:t].copy_(input_ids)
        self.pos[:t].copy_(positions)
        self.prologue.replay()
        return self.x

    def pre_attention(self, i: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's norm, QKV and RoPE; q, k, v of the step's `t` real rows."""
        self.pre[i].replay()
        q, k, v = self.qkv[i]
        return q[:t], k[:t], v[:t]

    def post_attention(self, i: int, attn: torch.Tensor) -> None:
        """Layer i's o-proj and MLP on the attention output `attn` [t, Hq·D]."""
        self.attn[: attn.shape[0]].copy_(attn)
        self.post[i].replay()


class StepGraphs:
    """A model's graphs, one `SizeGraphs` per padded size, captured on first use."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.sizes: dict[int, SizeGraphs] = {}
        #: Why capturing failed (graphs are then off for good and every step runs eagerly).
        self.disabled: str | None = None

    def for_tokens(self, t: int) -> SizeGraphs | None:
        """The graphs a step of `t` tokens replays, or None (too many tokens, or graphs off:
        run eagerly)."""
        if t < 1 or t > MAX_GRAPH_TOKENS or self.disabled is not None:
            return None
        size = SIZES[bisect.bisect_left(SIZES, t)]
        g = self.sizes.get(size)
        if g is None:
            try:
                g = self.sizes[size] = SizeGraphs(self.model, size)
            except RuntimeError as e:  # e.g. a driver or build that cannot capture
                self.disabled = f"{type(e).__name__}: {e}"
                self.sizes.clear()
                log.warning("CUDA graph capture failed at %d tokens; running eagerly: %s", size, e)
                return None
        return g
