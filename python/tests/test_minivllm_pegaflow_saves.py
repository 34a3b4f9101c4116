"""What the mini engine saves through `PegaflowConnector`, on the CPU against a real host-backend
server: a request's blocks are saved by the step that computes them (also the last step of a
request: all of a one-token request's prompt), and never when that step ran over a layer-wise
load that failed (vLLM drops the step's tokens and recomputes; those blocks' KV is wrong, and
stored under the prompt's hashes it would be served to every later request with that prefix)."""

from __future__ import annotations

import torch

from pegaflow.minivllm import EngineConfig, LLMEngine

from minivllm_runs import pega_engine, regions, run  # noqa: F401 (regions: a fixture)
from tiny_model import TINY, model, prompt  # noqa: F401 (model: a fixture)
from vllm_driver import out_of_range_targets


def test_a_one_token_request_saves_its_prompt(model, server, regions, uid):
    bs = TINY.block_size
    p = prompt(74, 5 * bs + 3)
    eng = pega_engine(model, server, regions, uid, "layerwise")
    try:
        cold, cold_logits, _, _ = run(eng, p, max_tokens=1)
        eng.drain(timeout_s=60)
        assert eng.reset_prefix_cache()
        eng.runner.fill_kv(7.0)  # only a load can restore the prompt's blocks
        warm, warm_logits, _, _ = run(eng, p, max_tokens=1)
        assert warm.num_external_computed_tokens == 5 * bs, "the one-token request saved nothing"
        assert warm.output_token_ids == cold.output_token_ids
        torch.testing.assert_close(warm_logits, cold_logits, rtol=1e-4, atol=1e-4)
        eng.drain(timeout_s=60)
    finally:
        eng.shutdown()


def test_blocks_computed_over_a_failed_layerwise_load_are_not_served_later(model, server, regions, uid):
    bs = TINY.block_size
    shared = prompt(71, 5 * bs)
    first = shared + prompt(72, 1)  # saves the 5 shared blocks
    second = shared + prompt(73, 3 * bs + 1)  # loads them, computes 3 more full blocks
    plain = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64), model=model)
    want, want_logits, _, _ = run(plain, second, max_tokens=1)
    eng = pega_engine(model, server, regions, uid, "layerwise", "worker")
    try:
        run(eng, first, max_tokens=1)
        eng.drain(timeout_s=60)
        assert eng.reset_prefix_cache()
        eng.runner.fill_kv(7.0)  # only a load could restore the shared blocks
        wc = eng.worker_connector._w()
        real_load = wc.client.load
        wc.client.load = out_of_range_targets(real_load)  # the server refuses this Load
        failed, _, _, _ = run(eng, second, max_tokens=1)
        wc.client.load = real_load
        assert wc.stats_snapshot()["load_failures"] == 1
        assert failed.output_token_ids == want.output_token_ids  # recomputed after the failure
        eng.drain(timeout_s=60)
        assert eng.reset_prefix_cache()
        eng.runner.fill_kv(7.0)
        again, logits, _, _ = run(eng, second, max_tokens=1)
        # PegaFlow holds the first request's 5 blocks, never the 3 computed over the failed load.
        assert again.num_external_computed_tokens == 5 * bs
        assert again.output_token_ids == want.output_token_ids
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        eng.drain(timeout_s=60)
    finally:
        eng.shutdown()
