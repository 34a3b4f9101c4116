"""The attention paths agree: the torch-SDPA path (flash on the GPU; CI's torch 1.13 has no SDPA,
so a reference SDPA with torch's documented semantics stands in) and the written-out path
give the same outputs for prefill, chunked (lower-right causal), single-query and ragged
batches with grouped KV heads — and the whole tiny engine gives the same tokens on both."""

from __future__ import annotations

import math
import random

import pytest
import torch

import pegaflow.minivllm.attention as A
from pegaflow.minivllm import CONFIGS, EngineConfig, LLMEngine, LlamaModel


def reference_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's documented math (is_causal: top-left)."""
    lq, lk = q.shape[-2], k.shape[-2]
    if enable_gqa:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    assert q.shape[-3] == k.shape[-3], "head counts differ without enable_gqa"
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        assert attn_mask is None
        attn_mask = torch.ones(lq, lk, dtype=torch.bool).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return torch.matmul(torch.softmax(s, -1), v.float()).to(q.dtype)


@pytest.fixture
def sdpa(monkeypatch):
    """Switch attention.py onto its SDPA path, backed by the reference."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", reference_sdpa, raising=False)
    monkeypatch.setattr(A, "HAS_SDPA", True)
    monkeypatch.setattr(A, "_SDPA_GQA", True)
    monkeypatch.setattr(A, "_bias_works", False)


def written_out(fn, *args):
    has = A.HAS_SDPA
    A.HAS_SDPA = False
    try:
        return fn(*args)
    finally:
        A.HAS_SDPA = has


@pytest.mark.parametrize("lq,lk", [(37, 37), (1, 50), (9, 50)])
def test_sdpa_path_equals_written_out_attention(sdpa, lq, lk):
    g = torch.Generator().manual_seed(lq * 100 + lk)
    q = torch.randn(lq, 8, 16, generator=g)
    k = torch.randn(lk, 2, 16, generator=g)
    v = torch.randn(lk, 2, 16, generator=g)
    want = written_out(A.attend, q, k, v, 0.25)
    got = A.attend(q, k, v, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_written_out_attention_is_lower_right_causal():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, generator=g)
    k = torch.randn(10, 2, 8, generator=g)
    v = torch.randn(10, 2, 8, generator=g)
    out = written_out(A.attend, q, k, v, 0.3)
    for i in range(3):  # query i sees keys [0, 10 - 3 + i]: same as a single query over them
        one = written_out(A.attend, q[i : i + 1], k[: 8 + i], v[: 8 + i], 0.3)
        torch.testing.assert_close(out[i : i + 1], one, rtol=1e-5, atol=1e-5)


def test_a_ragged_batch_equals_one_sequence_at_a_time(sdpa):
    """attend_varlen's per-sequence path (no flash here): decodes, a chunk over cached context and
    a fresh prefill packed back to back give what each sequence alone gives."""
    g = torch.Generator().manual_seed(2)
    shapes = [(1, 5), (1, 17), (6, 32), (9, 9)]  # (new queries, keys)
    tq, tk = sum(s[0] for s in shapes), sum(s[1] for s in shapes)
    q = torch.randn(tq, 8, 16, generator=g)
    k = torch.randn(tk, 2, 16, generator=g)
    v = torch.randn(tk, 2, 16, generator=g)
    spans, q0, k0 = [], 0, 0
    for lq, lk in shapes:
        spans.append((q0, lq, k0, lk))
        q0, k0 = q0 + lq, k0 + lk
    cu_q = torch.tensor([0] + [a + n for a, n, _, _ in spans], dtype=torch.int32)
    cu_k = torch.tensor([0] + [b + n for _, _, b, n in spans], dtype=torch.int32)
    got = A.attend_varlen(q, k, v, cu_q, cu_k, 9, 32, spans, 0.25)
    written = written_out(A.attend_varlen, q, k, v, cu_q, cu_k, 9, 32, spans, 0.25)
    for a, lq, b, lk in spans:
        want = written_out(A.attend, q[a : a + lq], k[b : b + lk], v[b : b + lk], 0.25)
        torch.testing.assert_close(got[a : a + lq], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(written[a : a + lq], want, rtol=1e-5, atol=1e-5)


def test_the_engine_gives_the_same_tokens_on_the_sdpa_path(sdpa):
    model = LlamaModel(CONFIGS["tiny"], "cpu", seed=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(1024) for _ in range(30 + 20 * i)] for i in range(3)]
    cfg = EngineConfig(model="tiny", num_gpu_blocks=64, max_num_batched_tokens=40)  # chunked too
    got = [o.output_token_ids for o in LLMEngine(cfg, model=model).generate(prompts, max_tokens=4)]
    A.HAS_SDPA = False
    want = [o.output_token_ids for o in LLMEngine(cfg, model=model).generate(prompts, max_tokens=4)]
    assert got == want
