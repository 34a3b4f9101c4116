"""The mini engine on its own (no connector): hashes, block pool, prefix caching, chunked
prefill and batched decode all give the tokens and logits of a plain full recompute."""

from __future__ import annotations

import pickle

import pytest
import torch

from pegaflow.connector.vllm_api import RequestStatus, SchedulerOutput
from pegaflow.minivllm import EngineConfig, LLMEngine, LlamaModel
from pegaflow.minivllm.kv_cache_manager import KVCacheManager
from pegaflow.hashes import chained_block_hashes
from pegaflow.minivllm.request import Request

from tiny_model import TINY, model, prompt  # noqa: F401 (model: a fixture)


def engine(model: LlamaModel, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks", 64)
    return LLMEngine(EngineConfig(model="tiny", **kw), model=model)


def test_request_block_hashes_match_the_typescript_client_vectors():
    # Vectors printed by lib/client/hashes.ts chainedBlockHashes for the same tokens.
    tokens = [i * 1000 + 7 for i in range(40)]
    assert [h.hex() for h in Request("v", tokens, block_size=16).block_hashes] == [
        "73c9fbf77b7f74ee3157382d076f4232",
        "134d7bc1e07e899b5545d2573481cc08",
    ]
    assert [h.hex() for h in Request("v", tokens, block_size=16, hash_salt="s1").block_hashes] == [
        "46c29cdec960ef0d052dd38b5cf8fd95",
        "1c8bb2ad4f28f63886926da82732b7c2",
    ]


def test_request_hashes_grow_with_output_tokens_and_cover_only_full_blocks():
    r = Request("r", list(range(31)), block_size=16, hash_salt="s")
    assert r.block_hashes == chained_block_hashes(list(range(31)), 16, "s")
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(5)
    assert len(r.block_hashes) == 2
    assert r.block_hashes == chained_block_hashes(list(range(31)) + [5], 16, "s")


def test_block_pool_refcounts_evict_cached_free_blocks_lru_and_never_hand_out_block_0():
    m = KVCacheManager(num_blocks=6, block_size=4)
    a = Request("a", list(range(9)), block_size=4)
    assert m.allocate_slots(a, 9).get_block_ids() == ([1, 2, 3],)
    m.free(a)  # blocks 1, 2 are cached (full); 3 is partial
    b = Request("b", list(range(9)), block_size=4)
    hits, n = m.get_computed_blocks(b)
    assert hits.get_block_ids() == ([1, 2],) and n == 8
    new = m.allocate_slots(b, 1, num_new_computed_tokens=8, new_computed_blocks=hits)
    assert new.get_block_ids() == ([4],)  # the least recently freed block
    assert [blk.ref_cnt for blk in m.block_pool.blocks[1:3]] == [1, 1]
    c = Request("c", [100 + i for i in range(8)], block_size=4)
    assert m.allocate_slots(c, 8) is not None  # takes the two remaining free blocks (5, 3)
    d = Request("d", [200 + i for i in range(4)], block_size=4)
    assert m.allocate_slots(d, 4) is None  # out of blocks: refused, nothing taken
    assert 0 not in {b.block_id for r in m.req_to_blocks.values() for b in r}
    assert m.reset_prefix_cache() is False  # blocks in use
    for r in (b, c):
        m.free(r)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(Request("e", list(range(9)), block_size=4))[1] == 0


def test_a_gpu_prefix_cache_hit_gives_the_first_token_and_logits_of_a_full_recompute(model):
    p = prompt(1, 150)
    eng = engine(model)
    cold = eng.generate([p], max_tokens=3)[0]
    warm_req = eng.add_request(p, max_tokens=3)
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in eng.step() if o.request_id == warm_req.request_id]
    assert warm_req.num_cached_tokens == 144  # 9 full blocks hit, the rest recomputed
    assert outs[-1].output_token_ids == cold.output_token_ids
    plain = engine(model, enable_prefix_caching=False)
    ref = plain.generate([p], max_tokens=1)[0]
    eng2 = engine(model)
    eng2.generate([p], max_tokens=1)
    eng2.generate([p], max_tokens=1)
    assert ref.output_token_ids[0] == cold.output_token_ids[0]
    (hit_logits,) = eng2.last_runner_output.logits.values()
    (ref_logits,) = plain.last_runner_output.logits.values()
    torch.testing.assert_close(hit_logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_shot_prefill(model):
    p = prompt(2, 200)
    one = engine(model, max_num_batched_tokens=4096)
    chunked = engine(model, max_num_batched_tokens=48)
    a = one.generate([p], max_tokens=4)[0]
    la = one.last_runner_output.logits
    b = chunked.generate([p], max_tokens=4)[0]
    lb = chunked.last_runner_output.logits
    assert a.output_token_ids == b.output_token_ids
    torch.testing.assert_close(next(iter(la.values())), next(iter(lb.values())), rtol=1e-4, atol=1e-4)


def test_batched_decode_gives_each_request_its_solo_tokens(model):
    prompts = [prompt(10 + i, 20 + 13 * i) for i in range(4)]
    solo = [engine(model).generate([p], max_tokens=5)[0].output_token_ids for p in prompts]
    together = engine(model).generate(prompts, max_tokens=5)
    assert [o.output_token_ids for o in together] == solo


def test_preemption_under_block_pressure_still_finishes_every_request_with_its_solo_tokens(model):
    prompts = [prompt(20 + i, 40) for i in range(3)]
    solo = [engine(model).generate([p], max_tokens=12)[0].output_token_ids for p in prompts]
    eng = engine(model, num_gpu_blocks=10)  # 9 usable blocks; 3 requests grow to 4 each
    reqs = [eng.add_request(p, max_tokens=12) for p in prompts]
    for _ in range(200):
        eng.step()
        if all(r.is_finished() for r in reqs):
            break
    assert [r.output_token_ids for r in reqs] == solo
    assert sum(r.num_preemptions for r in reqs) > 0


def test_scheduler_output_pickles_with_vllm_field_names(model):
    eng = engine(model)
    eng.add_request(prompt(3, 40), request_id="x")
    so = eng.scheduler.schedule()
    back = pickle.loads(pickle.dumps(so))
    assert isinstance(back, SchedulerOutput)
    assert back.scheduled_new_reqs[0].req_id == "x"
    assert back.num_scheduled_tokens == {"x": 40}
    assert back.total_num_scheduled_tokens == 40
    assert eng.scheduler.requests["x"].status == RequestStatus.RUNNING


def test_kv_caches_use_vllm_flash_attention_layout_and_layer_names(model):
    eng = engine(model, num_gpu_blocks=8)
    names = list(eng.runner.kv_caches)
    assert names == [f"model.layers.{i}.self_attn.attn" for i in range(TINY.num_layers)]
    for t in eng.runner.kv_caches.values():
        assert tuple(t.shape) == (2, 8, 16, TINY.num_kv_heads, TINY.head_dim)


def test_a_token_outside_the_vocabulary_is_refused_with_its_request_id(model):
    eng = engine(model)
    with pytest.raises(ValueError, match="r9.*token id 5000"):
        eng.add_request([1, 2, 5000], request_id="r9")
