"""The mini engine's CUDA graphs (`pegaflow.minivllm.graphs`) against its eager forward, on a
real GPU (skipped where torch sees no CUDA device). Same seed, same prompts: a cold prefill
(eager in both: too many tokens for a graph), decode steps and a prefix hit (graphs in one
engine, eager in the other) must sample the same tokens with logits equal to float32 noise.
Run on the GPU machine: `cd python && python3 -m pytest -q tests/test_minivllm_graphs_gpu.py`."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from pegaflow.minivllm.engine import EngineConfig, LLMEngine  # noqa: E402
from pegaflow.minivllm.graphs import MAX_GRAPH_TOKENS  # noqa: E402
from pegaflow.minivllm.llama import CONFIGS, LlamaModel  # noqa: E402


def _engine(graphs: bool) -> LLMEngine:
    cfg = CONFIGS["tiny"]
    model = LlamaModel(cfg, "cuda", seed=7, cuda_graphs=graphs)
    assert (model.graphs is not None) == graphs
    return LLMEngine(
        EngineConfig(model=cfg, num_gpu_blocks=256, max_num_batched_tokens=1024, device="cuda"),
        model=model,
    )


def _first_token_logits(eng: LLMEngine, prompt: list[int]):
    req = eng.add_request(prompt, max_tokens=1)
    while not req.is_finished():
        eng.step()
    return req.output_token_ids[0], eng.last_runner_output.logits[req.request_id].float().cpu()


def test_graphed_steps_sample_what_the_eager_forward_samples():
    rng = random.Random(3)
    vocab = CONFIGS["tiny"].vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (37, 300, 5)]
    graphed, eager = _engine(True), _engine(False)
    # Generation: the prompts' prefills (eager in both), then decode steps of 3, 2, 1 requests.
    out_g = graphed.generate(prompts, max_tokens=12)
    out_e = eager.generate(prompts, max_tokens=12)
    assert [o.output_token_ids for o in out_g] == [o.output_token_ids for o in out_e]
    assert graphed.model.graphs.sizes, "no step replayed a graph"
    assert all(s <= MAX_GRAPH_TOKENS for s in graphed.model.graphs.sizes)
    # A prefix hit: the re-sent prompt computes only its last block, a graphed step.
    for eng in (graphed, eager):
        eng.drain()
    tg, lg = _first_token_logits(graphed, prompts[1])
    te, le = _first_token_logits(eager, prompts[1])
    assert tg == te
    assert torch.allclose(lg, le, rtol=1e-3, atol=1e-3), (lg - le).abs().max()
