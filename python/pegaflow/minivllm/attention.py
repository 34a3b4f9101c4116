"""Causal attention with grouped KV heads: torch SDPA (flash on a GPU) where torch has it,
the same math written out where it does not (Debian's torch 1.13 on CI).

Causality is lower-right aligned, as in vLLM's paged attention: with `Lq` queries over `Lk`
keys (`Lq <= Lk`, the first `Lk - Lq` keys are the already-cached context), query i sees keys
`[0, Lk - Lq + i]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["HAS_SDPA", "attend", "attend_varlen"]

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
# enable_gqa arrived in torch 2.5; before it, K/V heads are repeated instead.
_SDPA_GQA = HAS_SDPA and tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

try:  # torch >= 2.3: a lower-right causal bias that still dispatches to flash / mem-efficient
    from torch.nn.attention.bias import causal_lower_right as _causal_lower_right
except ImportError:  # pragma: no cover - depends on the torch build
    _causal_lower_right = None


def _lower_right_mask(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """Boolean [lq, lk] mask, True where query i may see key j."""
    i = torch.arange(lq, device=device).unsqueeze(1)
    j = torch.arange(lk, device=device).unsqueeze(0)
    return j <= i + (lk - lq)


_bias_works = _causal_lower_right is not None

# Flash attention over ragged sequences (cu_seqlens), vLLM's FlashAttention call: one kernel for
# a whole mixed batch, GQA without repeated K/V, causality lower-right aligned per sequence.
# A private aten op: checked for at import, and dropped for good if this build refuses it.
_flash_varlen = getattr(getattr(getattr(torch.ops, "aten", None), "_flash_attention_forward", None), "default", None)
_flash_varlen_works = _flash_varlen is not None


def _sdpa_lower_right(qh, kh, vh, lq: int, lk: int, kw: dict) -> torch.Tensor:
    """Lq < Lk queries, lower-right causal: torch's CausalBias (flash-capable) when this torch
    accepts it with these arguments, else an explicit boolean mask."""
    global _bias_works
    if _bias_works:
        try:
            return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=_causal_lower_right(lq, lk), **kw)
        except (RuntimeError, TypeError, NotImplementedError):
            _bias_works = False  # e.g. a torch whose CausalBias dispatch lacks enable_gqa
    mask = _lower_right_mask(lq, lk, qh.device)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, **kw)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D] → [Lq, Hq, D]."""
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    if HAS_SDPA:
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
        kw: dict = {"scale": scale}
        if _SDPA_GQA:
            kw["enable_gqa"] = hq != hkv
        elif hq != hkv:
            kh = kh.repeat_interleave(hq // hkv, dim=1)
            vh = vh.repeat_interleave(hq // hkv, dim=1)
        if lq == lk:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **kw)
        elif lq == 1:
            o = F.scaled_dot_product_attention(qh, kh, vh, **kw)
        else:
            o = _sdpa_lower_right(qh, kh, vh, lq, lk, kw)
        return o.squeeze(0).transpose(0, 1)
    # Written out: query heads grouped under their KV head, scores in float32.
    g = hq // hkv
    qg = q.reshape(lq, hkv, g, d).permute(1, 2, 0, 3).float()  # [Hkv, G, Lq, D]
    kg = k.permute(1, 0, 2).unsqueeze(1).float()  # [Hkv, 1, Lk, D]
    vg = v.permute(1, 0, 2).unsqueeze(1).float()
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    if lq > 1:
        scores = scores.masked_fill(~_lower_right_mask(lq, lk, q.device), float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), vg)  # [Hkv, G, Lq, D]
    return o.permute(2, 0, 1, 3).reshape(lq, hq, d).to(q.dtype)


def attend_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    spans: list[tuple[int, int, int, int]],
    scale: float,
) -> torch.Tensor:
    """Ragged batch: sequence i has queries q[cu_q[i]:cu_q[i+1]] over keys k[cu_k[i]:cu_k[i+1]]
    (its context then its own new keys), lower-right causal. q [Tq, Hq, D], k/v [Tk, Hkv, D]
    → [Tq, Hq, D]. `cu_q`/`cu_k` are int32 device tensors; `spans` the same offsets on the host
    as (q_start, q_len, k_start, k_len), for the per-sequence path.

    One flash kernel on a GPU (bf16/fp16); elsewhere one `attend` per sequence.
    """
    global _flash_varlen_works
    if _flash_varlen_works and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        try:
            return _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]
        except (RuntimeError, TypeError, NotImplementedError):
            _flash_varlen_works = False  # e.g. a build without flash: the per-sequence path below
    outs = [attend(q[q0 : q0 + ql], k[k0 : k0 + kl], v[k0 : k0 + kl], scale) for q0, ql, k0, kl in spans]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
