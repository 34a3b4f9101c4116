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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from pegaflow.minivllm.attention import attend, attend_decode_batch

__all__ = ["CONFIGS", "LayerHooks", "LlamaConfig", "LlamaModel", "SeqInfo", "StepBatch"]


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
    """One request's slice of a step: tokens [q_start, q_start+q_len) of the flat batch."""

    q_start: int
    q_len: int
    kv_len: int  # context + this step's tokens
    block_table: torch.Tensor  # [num_blocks_needed] long, on the model's device
    fresh: bool  # no cached context: attend over this step's K/V without a gather


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset
    seqs: list[SeqInfo]
    logits_indices: torch.Tensor  # [n] rows of the flat batch to sample from
    # All seqs decode one token each: padded block tables [B, max_blocks] and lengths [B].
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None


class LayerHooks(Protocol):
    def layer_begin(self, i: int) -> None: ...

    def pre_attention(self, i: int) -> None: ...

    def post_attention(self, i: int, kv_cache: torch.Tensor) -> None: ...

    def layer_end(self, i: int) -> None: ...


class LlamaModel:
    """Weights and the forward over a `StepBatch`; stateless between steps."""

    def __init__(self, cfg: LlamaConfig, device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
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
        self.norm = torch.ones(h, dtype=dt, device=self.device)
        self.lm_head = randn(cfg.vocab_size, h)
        self.inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd)
        )
        self.scale = 1.0 / math.sqrt(hd)

    # ------------------------------------------------------------------ pieces

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return xf.to(x.dtype) * w

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        dt = self.cfg.torch_dtype
        return emb.cos().to(dt).unsqueeze(1), emb.sin().to(dt).unsqueeze(1)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, b: StepBatch
    ) -> torch.Tensor:
        cfg = self.cfg
        k_plane = cache[0].view(-1, cfg.num_kv_heads, cfg.head_dim)
        v_plane = cache[1].view(-1, cfg.num_kv_heads, cfg.head_dim)
        # vLLM's reshape_and_cache: the step's K/V go into their slots before anyone attends.
        k_plane[b.slot_mapping] = k
        v_plane[b.slot_mapping] = v
        if b.decode_block_tables is not None:
            kc = cache[0][b.decode_block_tables].flatten(1, 2)  # [B, blocks*bs, Hkv, D]
            vc = cache[1][b.decode_block_tables].flatten(1, 2)
            return attend_decode_batch(q, kc, vc, b.decode_seq_lens, self.scale)
        outs = []
        for s in b.seqs:
            qs = q[s.q_start : s.q_start + s.q_len]
            if s.fresh:
                ks = k[s.q_start : s.q_start + s.q_len]
                vs = v[s.q_start : s.q_start + s.q_len]
            else:
                ks = cache[0][s.block_table].flatten(0, 1)[: s.kv_len]
                vs = cache[1][s.block_table].flatten(0, 1)[: s.kv_len]
            outs.append(attend(qs, ks, vs, self.scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    # ------------------------------------------------------------------ forward

    @torch.no_grad()
    def forward(
        self, b: StepBatch, kv_caches: list[torch.Tensor], hooks: LayerHooks | None = None
    ) -> torch.Tensor:
        """Hidden states (after the final norm) of the `logits_indices` rows: [n, hidden]."""
        cfg = self.cfg
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self.embed[b.input_ids]
        cos, sin = self._rope(b.positions)
        t = x.shape[0]
        for i, w in enumerate(self.layers):
            if hooks is not None:
                hooks.layer_begin(i)
            h = self._rms_norm(x, w["in_norm"])
            qkv = h @ w["qkv"].t()
            q = qkv[:, : nq * hd].view(t, nq, hd)
            k = qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd)
            v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            if hooks is not None:
                hooks.pre_attention(i)
            attn = self._attention(q, k, v, kv_caches[i], b)
            if hooks is not None:
                hooks.post_attention(i, kv_caches[i])
            x = x + attn.reshape(t, nq * hd) @ w["o"].t()
            h = self._rms_norm(x, w["post_norm"])
            gate, up = (h @ w["gate_up"].t()).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w["down"].t()
            if hooks is not None:
                hooks.layer_end(i)
        return self._rms_norm(x[b.logits_indices], self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head.t()).float()
