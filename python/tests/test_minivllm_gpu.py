"""On a GPU (skipped elsewhere): the ragged flash path the engine uses for every step with cached
context (warm steps, chunked prefill, batched decode) gives what one SDPA call per sequence
gives, and the bf16 engine's prefix hit, chunked prefill and batched decode agree with a plain
recompute."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import pegaflow.minivllm.attention as A
from pegaflow.minivllm import CONFIGS, EngineConfig, LLMEngine, LlamaModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_ragged_flash_equals_one_sdpa_per_sequence():
    g = torch.Generator(device="cuda").manual_seed(3)
    # (new queries, keys): a decode, a chunk over cached context, a fresh prefill, a long decode.
    shapes = [(1, 50), (9, 50), (37, 37), (1, 3000), (16, 4096)]
    hq, hkv, d = 32, 8, 128
    tq, tk = sum(s[0] for s in shapes), sum(s[1] for s in shapes)
    q = torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(tk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(tk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    spans, q0, k0 = [], 0, 0
    for lq, lk in shapes:
        spans.append((q0, lq, k0, lk))
        q0, k0 = q0 + lq, k0 + lk
    cu_q = torch.tensor([0] + [s[0] + s[1] for s in spans], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + [s[2] + s[3] for s in spans], dtype=torch.int32, device="cuda")
    got = A.attend_varlen(q, k, v, cu_q, cu_k, max(s[0] for s in shapes), max(s[1] for s in shapes), spans, 0.088)
    assert A._flash_varlen_works, "the ragged flash kernel was refused: the engine fell back to one SDPA per sequence"
    for a, lq, b, lk in spans:
        want = A.attend(q[a : a + lq], k[b : b + lk], v[b : b + lk], 0.088)
        torch.testing.assert_close(got[a : a + lq], want, rtol=2e-2, atol=2e-2)


def bf16_tiny():
    return dataclasses.replace(CONFIGS["tiny"], name="tiny-bf16", dtype="bfloat16")


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0).item()


def test_bf16_engine_prefix_hit_chunks_and_batches_agree_with_a_recompute():
    cfg = bf16_tiny()
    model = LlamaModel(cfg, "cuda", seed=0)
    rng = random.Random(7)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(40 + 37 * i)] for i in range(4)]

    def engine(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=cfg, num_gpu_blocks=128, device="cuda", **kw), model=model)

    one = engine()
    one.generate([prompts[3]], max_tokens=1)
    full = next(iter(one.last_runner_output.logits.values()))
    one.generate([prompts[3]], max_tokens=1)  # the prefix-cache hit: 16-token step over the cache
    hit = next(iter(one.last_runner_output.logits.values()))
    chunked = engine(max_num_batched_tokens=24)
    chunked.generate([prompts[3]], max_tokens=1)
    chunk = next(iter(chunked.last_runner_output.logits.values()))
    assert cos(hit, full) >= 0.999 and cos(chunk, full) >= 0.999
    solo = [engine().generate([p], max_tokens=4)[0].output_token_ids for p in prompts]
    together = [o.output_token_ids for o in engine().generate(prompts, max_tokens=4)]
    same = sum(a == b for a, b in zip(solo, together))
    assert same >= 3, f"batched decode differs from solo runs in {4 - same} of 4 requests"
