"""Running one request of the mini engine to its end, for the engine tests (in-process and
the TP shard processes)."""

from __future__ import annotations

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
