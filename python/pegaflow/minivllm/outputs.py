"""What the model runner returns to the scheduler, and what the engine returns to its caller.

`ModelRunnerOutput` mirrors `vllm.v1.outputs.ModelRunnerOutput` (the fields used here) plus
three of ours: `logits` (the sampled rows, views on the model's device, for tests and the
benchmark's correctness checks), `timeline` (per-layer wait / compute times of the step, when
recorded) and `phases` (the step's host clock per phase, recorded with the timeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pegaflow.connector.vllm_api import KVConnectorOutput

__all__ = ["LayerTiming", "ModelRunnerOutput", "RequestOutput"]


@dataclass
class LayerTiming:
    """One layer of one step, in ms from the step's start.

    `wait_*` is the layer's wait for its load (on a GPU: when the stream reached the wait and
    got past it, whether the host blocked in `wait_for_layer_load` or the stream waited itself;
    CPU clock otherwise); `compute_*` is when the layer's kernels ran (CUDA events on a GPU,
    CPU clock otherwise).
    """

    layer: int
    wait_start_ms: float
    wait_end_ms: float
    compute_start_ms: float
    compute_end_ms: float


@dataclass
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    # One list per request in req_ids; empty for a request still in (chunked) prefill.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    kv_connector_output: KVConnectorOutput | None = None
    # time.perf_counter() when the sampled tokens reached the CPU (Request.arrival_time's clock).
    sampled_time: float = 0.0
    logits: dict[str, Any] = field(default_factory=dict)
    timeline: list[LayerTiming] | None = None
    # With a recorded timeline: time.perf_counter() at each phase of the step (the engine adds
    # the scheduler's), to see where a step's host time goes.
    phases: dict[str, float] | None = None


@dataclass
class RequestOutput:
    """A request's progress after one engine step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    output_token_ids: list[int]
    # Seconds from add_request to the first sampled token on the CPU (set once it exists).
    ttft_s: float | None = None
