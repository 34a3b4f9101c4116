"""Running the mini engine in the engine tests (in-process and the TP shard processes): one
request to its end, an engine wired to a server through `PegaflowConnector`, and the cold →
reset → warm sequence the end-to-end tests check."""

from __future__ import annotations

from typing import Callable, Optional

import pytest

from pegaflow.minivllm import LLMEngine


def run(eng: LLMEngine, prompt: list[int], max_tokens: int, max_steps: int = 2000):
    """(request, logits of its first token, its block table in that step, statuses seen)."""
    req = eng.add_request(prompt, max_tokens=max_tokens)
    first_logits = table = None
    seen = set()
    for _ in range(max_steps):
        eng.step()
        seen.add(req.status)
        if first_logits is None and req.num_output_tokens >= 1:
            first_logits = eng.last_runner_output.logits[req.request_id]
            table = list(eng.last_block_tables[req.request_id])
        if req.is_finished():
            break
    assert req.is_finished(), f"{req} did not finish"
    return req, first_logits, table, seen


@pytest.fixture
def regions():
    """Shared-memory regions an engine's KV lives in, closed after the test."""
    from pegaflow.regions import ShmRegion

    rs: list[ShmRegion] = []
    yield rs
    for r in rs:
        r.close()


def connector_config(engine_id: str, addr: str, namespace: str, **settings: object):
    """vLLM's KVTransferConfig for `PegaflowConnector`; `settings`: `pegaflow.*` keys without
    the prefix (None: left out)."""
    from pegaflow.connector.vllm_api import KVTransferConfig

    return KVTransferConfig(
        kv_connector="PegaflowConnector",
        kv_connector_module_path="pegaflow.connector.vllm",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={
            "pegaflow.addr": addr,
            "pegaflow.namespace": namespace,
            **{f"pegaflow.{k}": v for k, v in settings.items() if v is not None},
        },
    )


def pega_engine(
    model, server, regions, uid: str, mode: str, issuer: str | None = None, staging: int = 0,
    **extra: object,
) -> LLMEngine:
    """The tiny engine on the CPU with its KV in shm `regions`, connected to `server`;
    `extra`: more `pegaflow.*` settings (without the prefix)."""
    from pegaflow.minivllm import EngineConfig
    from pegaflow.minivllm.model_runner import shm_kv_cache_allocator

    ktc = connector_config(
        f"{uid}-{mode}", server.addr, f"ns-{uid}", mode=mode, load_issuer=issuer, staging_blocks=staging or None,
        **extra,
    )
    return LLMEngine(
        EngineConfig(model="tiny", num_gpu_blocks=64, kv_transfer_config=ktc),
        model=model,
        kv_cache_allocator=shm_kv_cache_allocator(regions),
    )


def cold_then_warm(
    eng: LLMEngine, prompt: list[int], tol: float, max_tokens: int = 3,
    before_warm: Optional[Callable[[], None]] = None,
):
    """Runs `prompt` cold, waits for its saves, runs `before_warm` (if given), resets the
    engine's prefix cache and scribbles over every KV block, then runs it warm: the warm
    request must load every full block but the one holding the last token (always
    recomputed) from PegaFlow byte-equal to the cold ones and give the cold tokens and
    logits (within `tol`). Returns (cold request, warm request, statuses the warm request
    went through)."""
    import torch

    bs = eng.model_config.block_size
    nfull = (len(prompt) - 1) // bs
    cold, cold_logits, cold_table, _ = run(eng, prompt, max_tokens=max_tokens)
    assert cold.num_external_computed_tokens == 0
    eng.drain(timeout_s=60)  # the connector frees the blocks once its Save is done
    stash = {name: t[:, cold_table[:nfull]].clone() for name, t in eng.runner.kv_caches.items()}
    if before_warm is not None:
        before_warm()
    assert eng.reset_prefix_cache()
    for t in eng.runner.kv_caches.values():  # only a real load can restore them
        t.fill_(7.0)
    warm, warm_logits, warm_table, seen = run(eng, prompt, max_tokens=max_tokens)
    assert warm.num_external_computed_tokens == nfull * bs
    for name, t in eng.runner.kv_caches.items():
        assert torch.equal(t[:, warm_table[:nfull]], stash[name]), f"{name}: loaded KV differs"
    assert warm.output_token_ids == cold.output_token_ids
    torch.testing.assert_close(warm_logits, cold_logits, rtol=tol, atol=tol)
    return cold, warm, seen
