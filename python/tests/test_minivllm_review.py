"""Review checks of the mini engine against references computed without paging: an
independent full-attention Llama forward over the same weights, and the block pool's and
scheduler's bookkeeping after whole runs (what vLLM's semantics say must hold)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pegaflow.connector.vllm_api import RequestStatus
from pegaflow.minivllm import EngineConfig, LLMEngine, LlamaModel
from pegaflow.minivllm.request import Request

from test_minivllm_connector_order import cold_then_reset, rec_engine
from tiny_model import TINY, model, prompt  # noqa: F401 (model: a fixture)


def reference_logits(m: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of `tokens`: one causal pass, no paging, no KV cache."""
    cfg = m.cfg
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = len(tokens)

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rope(x, pos):  # x [T, H, D], rotate-half RoPE
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        f = pos.double()[:, None] * inv[None]
        cos, sin = f.cos().repeat(1, 2)[:, None], f.sin().repeat(1, 2)[:, None]
        rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
        return x * cos + rot * sin

    pos = torch.arange(t)
    x = m.embed[torch.tensor(tokens)].double()
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for w in m.layers:
        h = norm(x, w["in_norm"].double())
        qkv = h @ w["qkv"].double().t()
        q = rope(qkv[:, : hq * d].view(t, hq, d), pos)
        k = rope(qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d), pos)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        k = k.repeat_interleave(hq // hkv, dim=1)  # query head j reads KV head j // (hq / hkv)
        v = v.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        s = s.masked_fill(~mask, float("-inf"))
        a = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(t, hq * d)
        x = x + a @ w["o"].double().t()
        h = norm(x, w["post_norm"].double())
        gate, up = (h @ w["gate_up"].double().t()).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w["down"].double().t()
    return (norm(x, m.norm.double()) @ m.lm_head.double().t()).float()


def run_collecting_logits(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, **kw):
    """Runs the prompts to completion; each request's sampled logits, step by step."""
    reqs = [eng.add_request(p, max_tokens=max_tokens, **kw) for p in prompts]
    logits: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
    for _ in range(500):
        if all(r.is_finished() for r in reqs):
            break
        outs = eng.step()
        for o in outs:
            logits[o.request_id].append(eng.last_runner_output.logits[o.request_id].clone())
    assert all(r.is_finished() for r in reqs), reqs
    return reqs, logits


def check_against_reference(m: LlamaModel, reqs, logits) -> None:
    for r in reqs:
        ref = reference_logits(m, r.all_token_ids)
        n = r.num_prompt_tokens
        assert len(logits[r.request_id]) == r.num_output_tokens
        for i, got in enumerate(logits[r.request_id]):
            torch.testing.assert_close(got, ref[n - 1 + i], rtol=1e-4, atol=1e-4)
            assert r.output_token_ids[i] == int(ref[n - 1 + i].argmax())


def test_one_shot_prefill_and_decode_equal_unpaged_full_attention(model):
    eng = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64), model=model)
    reqs, logits = run_collecting_logits(eng, [prompt(100, 37)], max_tokens=6)
    check_against_reference(model, reqs, logits)


def test_chunked_prefill_beside_decodes_equals_unpaged_full_attention(model):
    # A budget of 23 (not a block multiple): prompts are cut mid-block, several requests share
    # steps, later prompts are chunked beside earlier ones' decodes.
    eng = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64, max_num_batched_tokens=23), model=model)
    prompts = [prompt(101, 50), prompt(102, 9), prompt(103, 33), prompt(104, 16), prompt(101, 50)]
    reqs, logits = run_collecting_logits(eng, prompts, max_tokens=5)
    check_against_reference(model, reqs, logits)
    assert reqs[-1].num_cached_tokens == 48  # the first one's blocks, computed a chunk at a time


def test_prefix_hits_within_a_step_and_a_full_last_block_equal_unpaged_full_attention(model):
    eng = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64), model=model)
    p = prompt(105, 48)  # three full blocks: a whole-prompt hit must still compute the last token
    reqs, logits = run_collecting_logits(eng, [p, p, p[:40] + prompt(106, 5)], max_tokens=4)
    check_against_reference(model, reqs, logits)
    assert [r.num_cached_tokens for r in reqs] == [0, 32, 32]  # hits on blocks the first one computes
    again, logits = run_collecting_logits(eng, [p], max_tokens=3)
    assert again[0].num_cached_tokens == 32
    check_against_reference(model, again, logits)


def assert_nothing_left(eng: LLMEngine) -> None:
    """After drain: no request anywhere, every block free with no reference, block 0 untouched."""
    s, kvm = eng.scheduler, eng.kv_cache_manager
    pool = kvm.block_pool
    assert not (s.requests or s.running or s.waiting or s.skipped_waiting or s.finished_req_ids)
    assert not (kvm.req_to_blocks or kvm.num_cached_block)
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert [b.ref_cnt for b in pool.blocks[1:]] == [0] * (pool.num_blocks - 1)
    assert pool.null_block.ref_cnt == 1 and pool.null_block.block_hash is None
    assert not eng.runner.requests


def test_preemption_with_chunked_prefill_equals_unpaged_full_attention_and_returns_every_block(model):
    eng = LLMEngine(
        EngineConfig(model="tiny", num_gpu_blocks=10, max_num_batched_tokens=23), model=model
    )
    prompts = [prompt(110 + i, 40 + 3 * i) for i in range(3)]
    reqs, logits = run_collecting_logits(eng, prompts, max_tokens=12)
    assert sum(r.num_preemptions for r in reqs) > 0
    check_against_reference(model, reqs, logits)
    eng.drain()
    assert_nothing_left(eng)


def test_generation_stops_at_max_model_len_and_longer_prompts_are_refused():
    # vLLM caps a request at max_model_len tokens (FINISHED_LENGTH_CAPPED) and refuses a longer
    # prompt. Past it, the block table is capped and the step wrote K/V into the null block.
    cfg = dataclasses.replace(TINY, max_model_len=64)
    m = LlamaModel(cfg, "cpu", seed=0)
    eng = LLMEngine(EngineConfig(model=cfg, num_gpu_blocks=64), model=m)
    reqs, logits = run_collecting_logits(eng, [prompt(120, 60), prompt(121, 64)], max_tokens=10)
    assert [r.num_output_tokens for r in reqs] == [4, 1]
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    check_against_reference(m, reqs, logits)
    assert not eng.runner.kv_caches[cfg.layer_name(0)][:, 0].any(), "the null block was written"
    with pytest.raises(ValueError, match="r-long.*65 tokens.*max_model_len 64"):
        eng.add_request(prompt(122, 65), request_id="r-long")
    eng.drain()
    assert_nothing_left(eng)


def test_a_request_that_can_never_fit_the_kv_cache_is_refused_not_left_waiting_forever(model):
    # 3 usable blocks hold 48 tokens. A 60-token prompt never got a slot (WAITING forever); a
    # 47-token prompt with max_tokens 5 needs 51 slots: preempted at its 49th, it hit its own
    # cached blocks on readmission, found no block for the rest and stayed PREEMPTED forever.
    for budget in (8192, 16):
        eng = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=4, max_num_batched_tokens=budget), model=model)
        with pytest.raises(ValueError, match="big.*60 tokens.*48"):
            eng.add_request(prompt(1, 60), request_id="big")
        with pytest.raises(ValueError, match="long.*51 tokens.*48"):
            eng.add_request(prompt(1, 47), request_id="long", max_tokens=5)
        reqs, logits = run_collecting_logits(eng, [prompt(1, 47)], max_tokens=2)  # 48 slots: fits
        check_against_reference(model, reqs, logits)
        eng.drain()
        assert_nothing_left(eng)
        assert not eng.scheduler.has_work()


def test_blocks_recomputed_after_a_failed_sync_load_are_published_to_the_prefix_cache_again(model):
    # The failed load's blocks are evicted from the prefix cache and recomputed; the manager's
    # count of the request's published blocks must drop with them, or the recomputed blocks are
    # never published again and the next request with the same prefix misses the GPU cache.
    p = prompt(5, 150)
    log: list = []
    eng, cold, _ = cold_then_reset(model, log, {}, p, mode="sync")
    eng.worker_connector.fail_loads = True
    req = eng.add_request(p, max_tokens=3)
    eng.step()
    eng.worker_connector.fail_loads = False
    for _ in range(20):
        eng.step()
        if req.is_finished():
            break
    assert req.output_token_ids[0] == cold.output_token_ids[0]
    eng.drain()
    assert_nothing_left(eng)
    hits, n = eng.kv_cache_manager.get_computed_blocks(Request("again", p, block_size=TINY.block_size))
    assert n == 144
    again, logits = run_collecting_logits(eng, [p], max_tokens=2)
    assert again[0].num_cached_tokens == 144 and again[0].num_external_computed_tokens == 0
    check_against_reference(model, again, logits)


def test_a_drain_that_times_out_names_the_requests_it_waited_for(model):
    # The connector answers "ask later" forever: the request never leaves the waiting queue.
    eng = rec_engine(model, [], {}, none_first=10**9)
    eng.add_request(prompt(130, 20), request_id="stuck-1")
    with pytest.raises(TimeoutError, match="stuck-1"):
        eng.drain(timeout_s=0.2)


def test_without_chunked_prefill_a_prompt_over_the_token_budget_is_refused_not_left_blocking(model):
    # It could never be scheduled, and it sat at the head of the queue in front of every later
    # request (vLLM refuses such a config: max_num_batched_tokens < max_model_len).
    eng = LLMEngine(
        EngineConfig(model="tiny", num_gpu_blocks=64, max_num_batched_tokens=32, enable_chunked_prefill=False),
        model=model,
    )
    with pytest.raises(ValueError, match="r40.*40 tokens.*max_num_batched_tokens 32.*chunked prefill is off"):
        eng.add_request(prompt(2, 40), request_id="r40")
    reqs, logits = run_collecting_logits(eng, [prompt(1, 20), prompt(3, 32)], max_tokens=3)
    check_against_reference(model, reqs, logits)
    eng.drain()
    assert_nothing_left(eng)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_load_failing_mid_prefix_truncates_there_recomputes_and_counts_what_was_loaded(model, mode):
    # The 6th of 9 loaded blocks fails (its content scribbled). Two requests share the prompt: in
    # sync mode the second one's prefix-cache hits are the first one's blocks, loaded that step.
    p = prompt(5, 150)
    eng, _, _ = cold_then_reset(model, [], {}, p, mode=mode)
    eng.runner.fill_kv(7.0)
    w = eng.worker_connector
    start = w.start_load_kv

    def start_failing_block_5(ctx, **kw):
        loads = w._get_connector_metadata().loads
        start(ctx, **kw)
        for ld in loads:
            for t in w.kv_caches.values():
                t[:, ld.block_ids[5]].fill_(3.0)
            w._load_errors.add(ld.block_ids[5])

    w.start_load_kv = start_failing_block_5
    reqs, logits = run_collecting_logits(eng, [p, p], max_tokens=3)
    check_against_reference(model, reqs, logits)
    # What came from the connector and was usable: 5 blocks for the loader; none for a request
    # whose tokens were hits on the loader's blocks (it was counting -64).
    assert [r.num_external_computed_tokens for r in reqs] == ([80, 0] if mode == "sync" else [80, 80])
    eng.drain()
    assert_nothing_left(eng)
    assert eng.kv_cache_manager.get_computed_blocks(Request("x", p, block_size=TINY.block_size))[1] == 144


def test_eos_and_max_tokens_end_a_request_at_exactly_the_right_token(model):
    p = prompt(140, 30)
    ref = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64), model=model).generate([p], max_tokens=5)[0]
    eng = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64), model=model)
    eos = eng.add_request(p, max_tokens=5, eos_token_id=ref.output_token_ids[2])
    capped = eng.add_request(p, max_tokens=4)
    while eng.scheduler.has_work():
        eng.step()
    assert eos.output_token_ids == ref.output_token_ids[:3] and eos.status == RequestStatus.FINISHED_STOPPED
    assert capped.output_token_ids == ref.output_token_ids[:4]
    assert capped.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_nothing_left(eng)


def test_freed_blocks_are_evicted_tail_first_so_a_prefix_outlives_its_last_blocks(model):
    eng = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=5), model=model)  # 4 usable blocks
    a = prompt(150, 63)
    eng.generate([a], max_tokens=1)  # 4 blocks; 3 full ones cached
    eng.generate([prompt(151, 15)], max_tokens=1)  # takes one block: a's last (partial) one,
    eng.generate([prompt(152, 15)], max_tokens=1)  # then a's 3rd (the one before went to the tail)
    reqs, logits = run_collecting_logits(eng, [a], max_tokens=1)
    assert reqs[0].num_cached_tokens == 32  # a's first two blocks survived
    check_against_reference(model, reqs, logits)
