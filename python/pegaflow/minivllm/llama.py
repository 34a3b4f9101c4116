"""A Llama decoder over vLLM's paged KV cache, with random weights from a seed.

Shape and math of Llama-3 (RMSNorm, RoPE θ=500000 without Llama-3.1's long-context
frequency scaling, GQA, SwiGLU MLP), fused QKV and gate/up projections as in vLLM. The KV
cache of each layer is vLLM's FlashAttention layout `[2, num_blocks, block_size,
num_kv_heads, head_dim]` (K plane, then V plane). Per layer, vLLM's order: QKV + RoPE for the
step's tokens, then the attention op — write K/V into the cache by slot mapping, then attend
over each request's blocks gathered by its block table — then o-proj and MLP. The attention
op is bracketed by `LayerHooks` so a model runner can put vLLM's connector calls
(`wait_for_layer_load` before, `save_kv_layer` after) exactly where vLLM does.

Weights are random (std 0.02; output projections scaled by 1/sqrt(2·layers) so 32 layers stay
finite): the benchmark needs the real shapes and FLOPs, not a trained model.

Tensor parallelism (`tp_size` > 1, one process per rank in a `torch.distributed` group), as
vLLM shards Llama: rank r keeps KV heads [r·Hkv/tp, (r+1)·Hkv/tp) and the query heads that
attend to them (QKV column-parallel), the matching input rows of o-proj and a 1/tp slice of the
MLP (gate/up column-parallel, down row-parallel); o-proj's and down-proj's partial sums are
all-reduced, so every rank holds the whole hidden state and samples the same token. Each rank's
KV cache holds only its heads: `[2, num_blocks, block_size, Hkv/tp, head_dim]`. Every rank draws
the full weights from the same seed and keeps its slice, so the ranks agree without a transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed
import torch.nn.functional as F

from pegaflow.minivllm.attention import attend, attend_varlen
from pegaflow.minivllm.graphs import StepGraphs

__all__ = ["CONFIGS", "LayerHooks", "LlamaConfig", "LlamaModel", "SeqInfo", "StepBatch"]

_HAS_RMS_NORM = hasattr(F, "rms_norm")


@dataclass(frozen=True)
class LlamaConfig:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    dtype: str = "float32"
    block_size: int = 16
    max_model_len: int = 131072

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def layer_name(self, i: int) -> str:
        """vLLM's attention layer name; layer names sort in execution order only below 10."""
        return f"model.layers.{i}.self_attn.attn"

    def kv_bytes_per_token(self) -> int:
        esize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * esize


CONFIGS: dict[str, LlamaConfig] = {
    # CPU tests: float32 so a prefix-cache hit and a recompute agree to ~1e-5.
    "tiny": LlamaConfig(
        name="tiny",
        num_layers=4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=1024,
        dtype="float32",
        max_model_len=16384,
    ),
    "llama-3.1-8b": LlamaConfig(
        name="llama-3.1-8b",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        dtype="bfloat16",
    ),
}


@dataclass
class SeqInfo:
    """One request's slice of a step: queries [q_start, q_start+q_len) of the flat batch, keys
    [k_start, k_start+kv_len) of the step's gathered K/V (its context, then its new tokens)."""

    q_start: int
    q_len: int
    kv_len: int  # context + this step's tokens
    k_start: int
    fresh: bool  # no cached context: attend over this step's K/V without a gather


@dataclass
class StepBatch:
    """A step's inputs, built once per step on the host and copied to the device in one go;
    every layer reuses them (no per-layer index building, no host round trip in the forward)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset
    seqs: list[SeqInfo]
    logits_indices: torch.Tensor  # [n] rows of the flat batch to sample from
    # The cached keys to attend over, gathered once per layer (both planes at once): every
    # sequence's slots, context then new tokens, back to back (the ragged attention), or, with
    # `gather_blocks`, the one sequence's block ids (whole blocks, then its first kv_len slots).
    # None when every sequence is fresh (its keys are the step's own K/V).
    kv_gather: torch.Tensor | None = None
    gather_blocks: bool = False
    cu_q: torch.Tensor | None = None  # [S+1] int32 query offsets
    cu_k: torch.Tensor | None = None  # [S+1] int32 key offsets
    max_q: int = 0
    max_k: int = 0
    # The same offsets on the host, (q_start, q_len, k_start, k_len) per sequence.
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)


class LayerHooks(Protocol):
    """Called around each layer's attention; `layer_begin` / `layer_end` may be None (a caller
    that does not time layers: two Python calls a layer fewer in a launch-bound step)."""

    def layer_begin(self, i: int) -> None: ...

    def pre_attention(self, i: int) -> None: ...

    def post_attention(self, i: int, kv_cache: torch.Tensor) -> None: ...

    def layer_end(self, i: int) -> None: ...


class LlamaModel:
    """Weights and the forward over a `StepBatch`; stateless between steps."""

    def __init__(
        self,
        cfg: LlamaConfig,
        device: str | torch.device = "cpu",
        seed: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        cuda_graphs: bool = True,
    ) -> None:
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1}")
        if cfg.num_kv_heads % tp_size or cfg.intermediate_size % tp_size:
            raise ValueError(
                f"tp_size {tp_size} must divide num_kv_heads {cfg.num_kv_heads} and "
                f"intermediate_size {cfg.intermediate_size} of {cfg.name}"
            )
        self.cfg = cfg
        self.device = torch.device(device)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # This rank's heads: KV heads, and the query heads grouped under them.
        self.kv_heads = cfg.num_kv_heads // tp_size
        self.q_heads = cfg.num_heads // tp_size
        dt = cfg.torch_dtype
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * cfg.num_layers)
        h, hd = cfg.hidden_size, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd

        def randn(*shape: int, s: float = std) -> torch.Tensor:
            return torch.empty(*shape, dtype=dt, device=self.device).normal_(0.0, s, generator=gen)

        self.embed = randn(cfg.vocab_size, h)
        self.layers = []
        for _ in range(cfg.num_layers):
            self.layers.append(
                {
                    "in_norm": torch.ones(h, dtype=dt, device=self.device),
                    "qkv": randn(qkv_out, h),
                    "o": randn(h, cfg.num_heads * hd, s=out_std),
                    "post_norm": torch.ones(h, dtype=dt, device=self.device),
                    "gate_up": randn(2 * cfg.intermediate_size, h),
                    "down": randn(h, cfg.intermediate_size, s=out_std),
                }
            )
        if tp_size > 1:
            self.layers = [self._shard(w) for w in self.layers]
        # The forward's view of the weights: GEMM operands pre-transposed, one tuple a layer (every
        # torch call costs ~10 us of CPU, and the warm step is launch-bound).
        self._fw = [
            (w["in_norm"], w["qkv"].t(), w["o"].t(), w["post_norm"], w["gate_up"].t(), w["down"].t())
            for w in self.layers
        ]
        # CUDA graphs of the small steps' dense halves (a prefix hit's step, decode): on a GPU,
        # one process per model (the all-reduce of tp_size > 1 stays eager).
        self.graphs = StepGraphs(self) if cuda_graphs and self.device.type == "cuda" and tp_size == 1 else None
        self.norm = torch.ones(h, dtype=dt, device=self.device)
        self.lm_head = randn(cfg.vocab_size, h)
        self.inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd)
        )
        self.scale = 1.0 / math.sqrt(hd)

    def _shard(self, w: dict) -> dict:
        """This rank's slice of one layer's weights. QKV rows are Q heads in head order, then K,
        then V heads; query head j attends KV head j // (Hq/Hkv) (attention.py), so a rank's
        query heads are one contiguous run, as are its K and V heads."""
        cfg, r, hd = self.cfg, self.tp_rank, self.cfg.head_dim
        nq, nkv, ql, kl = cfg.num_heads, cfg.num_kv_heads, self.q_heads, self.kv_heads
        il = cfg.intermediate_size // self.tp_size
        inter = cfg.intermediate_size
        qkv = w["qkv"]
        q = qkv[r * ql * hd : (r + 1) * ql * hd]
        k = qkv[(nq + r * kl) * hd : (nq + (r + 1) * kl) * hd]
        v = qkv[(nq + nkv + r * kl) * hd : (nq + nkv + (r + 1) * kl) * hd]
        gu = w["gate_up"]
        return {
            "in_norm": w["in_norm"],
            "qkv": torch.cat([q, k, v]).contiguous(),
            "o": w["o"][:, r * ql * hd : (r + 1) * ql * hd].contiguous(),
            "post_norm": w["post_norm"],
            "gate_up": torch.cat([gu[r * il : (r + 1) * il], gu[inter + r * il : inter + (r + 1) * il]]).contiguous(),
            "down": w["down"][:, r * il : (r + 1) * il].contiguous(),
        }

    def _reduce_into(self, x: torch.Tensor, a: torch.Tensor, w_t: torch.Tensor) -> None:
        """x += a @ w_t, summed over the TP ranks (each holds a slice of the contraction)."""
        if self.tp_size == 1:
            x.addmm_(a, w_t)
            return
        part = torch.mm(a, w_t)
        torch.distributed.all_reduce(part)
        x.add_(part)

    # ------------------------------------------------------------------ pieces

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if _HAS_RMS_NORM:  # one fused kernel on CUDA (torch >= 2.8), float32 inside
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return xf.to(x.dtype) * w

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [T, 1, 1, D]: rotate(x) = x*cos + swap_halves(x)*sin."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        dt = self.cfg.torch_dtype
        cos = freqs.cos().repeat(1, 2).to(dt)
        sin = freqs.sin()
        sin = torch.cat([-sin, sin], dim=-1).to(dt)
        return cos[:, None, None, :], sin[:, None, None, :]

    def kv_planes(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of one layer's paged cache, made once: K and V planes as [slots, 1, Hkv, D] (the
        shape the step's K/V come in), both planes as [2, slots, Hkv, D] for a slot gather, and
        as [2, blocks, block bytes] for a block gather."""
        both = cache.view(2, -1, self.kv_heads, self.cfg.head_dim)
        k, v = both.unsqueeze(2).unbind(0)
        return k, v, both, cache.view(2, cache.shape[1], -1)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        planes: tuple[torch.Tensor, ...],
        b: StepBatch,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, 1, Hkv, D] (views): vLLM's reshape_and_cache (the step's K/V into
        their slots before anyone attends), then attention over each request's context."""
        k_plane, v_plane, both, blocks = planes
        k_plane.index_copy_(0, b.slot_mapping, k)
        v_plane.index_copy_(0, b.slot_mapping, v)
        if b.kv_gather is None:  # every sequence fresh: its keys are the step's own
            k, v = k.squeeze(1), v.squeeze(1)
            if len(b.seqs) == 1:  # a plain prefill: SDPA's causal flash path, as transformers
                return attend(q, k, v, self.scale)
            return attend_varlen(q, k, v, b.cu_q, b.cu_k, b.max_q, b.max_k, b.spans, self.scale)
        if b.gather_blocks:
            # One sequence over its cached context (a prefix hit's step, a decode of one request).
            # Its whole blocks in one gather of block-sized rows (a slot gather of 10K keys took
            # 70 us a layer on an H100), then dense SDPA, whose flash kernel splits a long context
            # over the SMs; the ragged kernel runs few queries as one CTA per head (16 queries
            # over 10K keys: 0.30 ms vs 0.09 ms a layer).
            kv = blocks.index_select(1, b.kv_gather).view(2, -1, self.kv_heads, self.cfg.head_dim)
            kc, vc = kv[:, : b.seqs[0].kv_len].unbind(0)
            return attend(q, kc, vc, self.scale)
        kc, vc = both.index_select(1, b.kv_gather).unbind(0)  # one gather kernel, both planes
        return attend_varlen(q, kc, vc, b.cu_q, b.cu_k, b.max_q, b.max_k, b.spans, self.scale)

    # ------------------------------------------------------------------ forward

    def _pre_attention(
        self, w: tuple, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer up to its attention: norm, fused QKV, RoPE of Q and K at once. Returns q
        [T, Hq, D] and k, v [T, 1, Hkv, D] (views). Captured as is by `graphs.StepGraphs`."""
        cfg = self.cfg
        nq, nkv, hd = self.q_heads, self.kv_heads, cfg.head_dim
        g = nq // nkv
        half = hd // 2
        t = x.shape[0]
        h = F.rms_norm(x, (x.shape[-1],), w[0], cfg.rms_norm_eps) if _HAS_RMS_NORM else self._rms_norm(x, w[0])
        qkv = torch.mm(h, w[1]).view(t, g + 2, nkv, hd)  # Q as g groups of nkv heads, K, V
        qk = qkv[:, : g + 1]
        # RoPE of Q and K at once: x*cos + swap_halves(x)*sin (sin sign-folded).
        rot = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        rot.mul_(sin)
        rot.addcmul_(qk, cos)
        q, k = rot.split((g, 1), dim=1)
        return q.reshape(t, nq, hd), k, qkv[:, g + 1 :]

    def _post_attention(self, w: tuple, x: torch.Tensor, attn: torch.Tensor) -> None:
        """A layer after its attention, in place on the residual stream `x`: o-proj, norm, MLP
        (the residual added by the o-proj and down-proj GEMMs). `attn` is [T, Hq·D]."""
        self._reduce_into(x, attn, w[2])
        eps = self.cfg.rms_norm_eps
        h = F.rms_norm(x, (x.shape[-1],), w[3], eps) if _HAS_RMS_NORM else self._rms_norm(x, w[3])
        gate, up = torch.mm(h, w[4]).chunk(2, dim=-1)
        F.silu(gate, inplace=True).mul_(up)
        self._reduce_into(x, gate, w[5])

    @torch.no_grad()
    def forward(
        self,
        b: StepBatch,
        kv_caches: list[torch.Tensor],
        hooks: LayerHooks | None = None,
        planes: list[tuple[torch.Tensor, ...]] | None = None,
    ) -> torch.Tensor:
        """Hidden states (after the final norm) of the `logits_indices` rows: [n, hidden].

        Launch-lean: ~15 kernels and ~27 torch calls a layer (fused QKV and gate/up, RoPE of Q
        and K together, the residual added by the o-proj and down-proj GEMMs, weights and cache
        views prepared once), no host sync inside. A step of at most `graphs.MAX_GRAPH_TOKENS`
        tokens on a GPU replays each layer's dense halves as CUDA graphs (`graphs.py`; vLLM's
        piecewise graphs: the attention and the connector hooks stay eager). `planes`:
        `kv_planes` of each cache, when the caller keeps them."""
        if planes is None:
            planes = [self.kv_planes(c) for c in kv_caches]
        t = b.input_ids.shape[0]
        graphs = self.graphs.for_tokens(t) if self.graphs is not None else None
        if graphs is not None:
            x = graphs.begin(b.input_ids, b.positions)
        else:
            x = self.embed[b.input_ids]
            cos, sin = self._rope(b.positions)
        nqd = self.q_heads * self.cfg.head_dim
        begin = hooks.layer_begin if hooks is not None else None
        end = hooks.layer_end if hooks is not None else None
        for i, w in enumerate(self._fw):
            if begin is not None:
                begin(i)
            if graphs is not None:
                q, k, v = graphs.pre_attention(i, t)
            else:
                q, k, v = self._pre_attention(w, x, cos, sin)
            if hooks is not None:
                hooks.pre_attention(i)
            attn = self._attention(q, k, v, planes[i], b).reshape(t, nqd)
            if hooks is not None:
                hooks.post_attention(i, kv_caches[i])
            if graphs is not None:
                graphs.post_attention(i, attn)
            else:
                self._post_attention(w, x, attn)  # x is this forward's own tensor
            if end is not None:
                end(i)
        return self._rms_norm(x[b.logits_indices], self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head.t()).float()
