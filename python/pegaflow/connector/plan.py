"""What both sides of the connector agree on: the modes and load issuers, the namespace and
name rules, and the picklable plan the scheduler hands the workers each step (vLLM carries it
in the step's metadata, across processes). The scheduler side is scheduler_core.py, the worker
side worker_core.py; vllm.py maps vLLM's objects onto them."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

LAYERWISE = "layerwise"
ASYNC = "async"
MODES = (LAYERWISE, ASYNC)
#: Who sends the Load RPC: the scheduler as soon as it knows the target blocks
#: (the copy starts one RPC earlier), the worker in start_load_kv, or (with
#: staging blocks) the probe itself, riding on the QueryPrefetch (query_issuer.py).
ISSUER_SCHEDULER = "scheduler"
ISSUER_WORKER = "worker"
ISSUER_QUERY = "query"
LOAD_ISSUERS = (ISSUER_SCHEDULER, ISSUER_WORKER, ISSUER_QUERY)
_NAME_OK = re.compile(r"[^A-Za-z0-9._-]")


def derive_namespace(
    *,
    model: str,
    dtype: str,
    tp_size: int,
    pp_size: int,
    num_kv_heads: int,
    head_size: int,
    num_layers: int,
    block_size: int,
    cache_dtype: str,
    layout: str = "",
    extra: Optional[Mapping[str, Any]] = None,
) -> str:
    """A namespace that changes with every factor of the stored layout, so
    only engines whose blocks are interchangeable share blocks. Readable
    model prefix + 16 hex digits of sha256 over all factors; fits the
    server's name rule ([A-Za-z0-9._-], <= 128).

    Example:
        derive_namespace(model="meta-llama/Llama-3.1-8B", dtype="bfloat16", tp_size=1, pp_size=1,
                         num_kv_heads=8, head_size=128, num_layers=32, block_size=16, cache_dtype="auto")
        # 'Llama-3.1-8B-3f1c...'
    """
    factors = dict(
        model=model, dtype=str(dtype), tp_size=tp_size, pp_size=pp_size, num_kv_heads=num_kv_heads,
        head_size=head_size, num_layers=num_layers, block_size=block_size, cache_dtype=str(cache_dtype),
        layout=layout, **{k: str(v) for k, v in (extra or {}).items()},
    )
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]
    stem = _NAME_OK.sub("-", model.rstrip("/").split("/")[-1])[:96] or "model"
    return f"{stem}-{digest}"


def safe_name(s: str) -> str:
    """`s` with characters outside the server's name rule replaced by '-'."""
    return _NAME_OK.sub("-", s)[:128] or "pegaflow"


# ---- what crosses from the scheduler to the workers (picklable) -------------


@dataclass
class LoadIntent:
    """Load the leased prefix into `block_ids` (the request's blocks after its
    locally computed prefix). `states` is set when the scheduler already sent
    the Load of every rank: (tp_rank, pp_rank) → that rank's load-state name,
    which the rank's worker attaches to instead of sending a Load."""

    request_id: str
    lease_id: bytes
    block_ids: List[int]
    states: Optional[Dict[Tuple[int, int], str]] = None
    # Staged (staging.py): `block_ids` are staging blocks of `<instance>.staging`, and each
    # layer is scattered from there into these, the request's own blocks.
    scatter_to: Optional[List[int]] = None

    @property
    def targets(self) -> List[int]:
        """The request's blocks this load fills (recomputed if it fails)."""
        return self.scatter_to if self.scatter_to is not None else self.block_ids


@dataclass
class SaveIntent:
    """Save these full blocks of a request (ids + the engine's block hashes). `after_loads`: the
    requests whose layer-wise loads (of this step or an earlier one) fill blocks these were
    computed over (or are): when one of those loads failed, they hold KV computed over wrong KV
    (the engine may have scheduled this step before it saw the failure), and the save is dropped."""

    request_id: str
    block_ids: List[int]
    block_hashes: List[bytes]
    after_loads: Tuple[str, ...] = ()


@dataclass
class StepPlan:
    """Everything the workers do for one step."""

    loads: List[LoadIntent] = field(default_factory=list)
    saves: List[SaveIntent] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)

    def __reduce__(self) -> Tuple[type, Tuple[List[LoadIntent], List[SaveIntent], List[str]]]:
        # Pickled every step (scheduler → workers): by position, half the time of the default
        # (a class reference and a field-name dict per object).
        return StepPlan, (self.loads, self.saves, self.preempted)


class ScheduledRequest(NamedTuple):
    """One request in a step's schedule: `block_ids` is its new blocks
    (appended) or, with `replace_blocks`, all of them (new or resumed). A tuple: the
    connector builds one per running request per step, so a plain tuple of the same
    five fields is accepted too."""

    request_id: str
    block_ids: Optional[Sequence[int]]
    replace_blocks: bool
    num_computed_tokens: int
    num_scheduled_tokens: int

