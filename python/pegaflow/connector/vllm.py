"""`PegaflowConnector`: vLLM's KV connector v1 (`KVConnectorBase_V1`) over
PegaFlow. It maps vLLM's objects onto the engine-agnostic state machines
in scheduler_core.py / worker_core.py and holds no policy of its own.

Written against vllm-project/vllm `vllm/distributed/kv_transfer/kv_connector/
v1/base.py` @ 003df2961dd8830c317a61f9745ccd557da9fa06. It subclasses vLLM's
own base class when vLLM is importable (new optional methods keep vLLM's
defaults), else our stand-in `pegaflow.connector.vllm_api`. vLLM attributes
read here (all present at that commit):
  vllm_config.kv_transfer_config.{engine_id, kv_connector_extra_config, get_from_extra_config}
  vllm_config.model_config.{model, dtype, use_mla, get_num_kv_heads(pc), get_head_size(),
    get_total_num_hidden_layers() (or hf_text_config.num_hidden_layers)}
  vllm_config.cache_config.{block_size, cache_dtype}
  vllm_config.parallel_config.{tensor_parallel_size, pipeline_parallel_size, rank,
    decode_context_parallel_size, prefill_context_parallel_size (if present)}
  kv_cache_config.{kv_cache_groups, needs_kv_cache_zeroing} (if given)
  vllm_config.scheduler_config.async_scheduling (default load issuer only)
  request.{request_id, block_hashes, num_tokens, num_publishable_block_hashes (if present)}
  KVCacheBlocks.get_block_ids()
  SchedulerOutput.{scheduled_new_reqs[].{req_id, block_ids, num_computed_tokens},
    scheduled_cached_reqs.{req_ids, new_block_ids, num_computed_tokens, resumed_req_ids
    (or the older resumed_from_preemption)}, num_scheduled_tokens, preempted_req_ids}
  KVConnectorOutput.{finished_sending, finished_recving, invalid_block_ids}

Use: `--kv-transfer-config '{"kv_connector":"PegaflowConnector",
"kv_connector_module_path":"pegaflow.connector.vllm","kv_role":"kv_both",
"kv_connector_extra_config":{"pegaflow.addr":"127.0.0.1:50055","pegaflow.mode":"layerwise"}}'`
Extra config keys (env fallback): pegaflow.addr (PEGAFLOW_ADDR), pegaflow.mode
(PEGAFLOW_MODE: "layerwise" | "async"), pegaflow.rpc_timeout_ms, pegaflow.save_timeout_ms,
pegaflow.load_timeout_ms (PEGAFLOW_*_TIMEOUT_MS), pegaflow.instance_id
(PEGAFLOW_INSTANCE_ID; default kv_transfer_config.engine_id: every rank also registers with that
engine_id, and every query, Load and Save carries it, so the server refuses a rank and the
requests of another engine given the same instance id; see `engine_id_of`), pegaflow.namespace
(PEGAFLOW_NAMESPACE; default derived from every layout factor), pegaflow.load_issuer
(PEGAFLOW_LOAD_ISSUER: "scheduler" | "worker" | "query"; default below), pegaflow.staging_blocks
(PEGAFLOW_STAGING_BLOCKS: layer-wise loads through that many staging blocks per layer, so a
load's copies stay contiguous whatever blocks the engine gave the request; 0 = off, the
default; connector/staging.py), pegaflow.device_id
(PEGAFLOW_DEVICE_ID: the device a host-backend worker registers under, for a server that
serves several; CUDA KV registers the device its tensors are on), pegaflow.gpu_waits
(PEGAFLOW_GPU_WAITS: "1" | "0"; default 1: layer-wise loads on CUDA wait on the GPU stream,
not the host, so the forward is launched ahead and each layer starts as its bytes land;
pegaflow/gpu_wait.py), pegaflow.loading_wait_ms (PEGAFLOW_LOADING_WAIT_MS: after a "loading"
answer a WaitPrefetch holds up to this many ms and the request is asked again once it is
answered, when the fetch ended; 0 = poll instead; default in connector/scheduler_core.py),
pegaflow.loading_retry_ms (PEGAFLOW_LOADING_RETRY_MS: when polling, a request answered "loading"
is asked again after a pause that doubles up to this many ms; 0 = at every call; default and
first pause in connector/scheduler_core.py).

Who sends the Load (pegaflow.load_issuer):
  worker     start_load_kv sends it, one per rank, after handle_preemptions, in
             the step that runs the request (always safe).
  scheduler  update_state_after_alloc sends it for every TP/PP rank as soon as
             the target blocks are known (each rank with its own load state,
             created by the scheduler); the state names travel in the step's
             metadata and each worker attaches to its rank's (no RPC) in
             start_load_kv; wait_for_layer_load waits on it as before. The copy
             starts about one RPC and the worker's preparation earlier.
  query      with staging blocks (layer-wise), the probe's QueryPrefetch carries every
             rank's load into a staging run (connector/query_issuer.py): the copy starts
             before the scheduler allocates. Opt-in; same safety rule as "scheduler".
  Safety rule of the scheduler issuer: the copy may start before the workers
  run the step, so it is safe only when the engine schedules synchronously:
  the previous step's forward has finished before the scheduler runs, so no
  kernel still reads or writes blocks just reallocated to this request (and a
  step that preempted admits no new request, so the preempted requests'
  pending saves were waited for by handle_preemptions in that step). vLLM's
  async scheduling (and PP's batch queue) breaks that: a block freed during
  schedule(N+1) may still be read by step N. Hence the default: "scheduler"
  only when scheduler_config.async_scheduling is explicitly False and there
  is one pipeline stage, else "worker". vLLM resolves async_scheduling to True
  unless an option forbids it: an explicit "scheduler" or "query" is honoured,
  with a warning, and needs `vllm serve --no-async-scheduling`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Set, Tuple

from ..client import MAX_PREFETCH_WAIT_MS, PegaflowClient
from ..config import ClientConfig
from .plan import (
    ASYNC,
    ISSUER_SCHEDULER,
    ISSUER_WORKER,
    LAYERWISE,
    LOAD_ISSUERS,
    MODES,
    ScheduledRequest,
    StepPlan,
    derive_namespace,
    safe_name,
)
from .scheduler_core import LOADING_RETRY_MAX_S, LOADING_WAIT_MS, SchedulerCore
from .worker_core import SAVE_GATE_S, WorkerCore

try:  # the real vLLM when it is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    HAVE_VLLM = True
except ImportError:
    from .vllm_api import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

    HAVE_VLLM = False

log = logging.getLogger("pegaflow.connector.vllm")


@dataclass
class PegaflowConnectorMetadata(KVConnectorMetadata):
    """One step's plan (load intents, save intents, preempted ids); pickles."""

    plan: StepPlan

    def __reduce__(self) -> Tuple[type, Tuple[StepPlan]]:
        return PegaflowConnectorMetadata, (self.plan,)  # by position, as StepPlan


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector reads from kv_connector_extra_config (env fallback)."""

    mode: str
    instance_id: str
    namespace: str
    client: ClientConfig
    load_issuer: str = ISSUER_WORKER
    # Device id this worker registers its KV under (pegaflow.device_id / PEGAFLOW_DEVICE_ID): only
    # for host-backend (shm) KV; CUDA tensors name their own device.
    device_id: Optional[int] = None
    # Staging blocks per layer for layer-wise loads (pegaflow.staging_blocks /
    # PEGAFLOW_STAGING_BLOCKS; 0 = load straight into the request's blocks): see
    # connector/staging.py. Costs that many blocks of KV memory per layer on every rank.
    staging_blocks: int = 0
    # Layer-wise waits on the GPU stream (pegaflow.gpu_waits / PEGAFLOW_GPU_WAITS): gpu_wait.py.
    gpu_waits: bool = True
    # Longest pause before a request answered "loading" is asked again (pegaflow.loading_retry_ms /
    # PEGAFLOW_LOADING_RETRY_MS; 0 = ask at every call; None = scheduler_core.LOADING_RETRY_MAX_S).
    loading_retry_ms: Optional[int] = None
    # After a "loading" answer, the longest WaitPrefetch hold (pegaflow.loading_wait_ms /
    # PEGAFLOW_LOADING_WAIT_MS; the server answers as the fetch ends; 0 = poll with the pauses of
    # loading_retry_ms instead; None = scheduler_core.LOADING_WAIT_MS; at most 60000).
    loading_wait_ms: Optional[int] = None
    # The engine incarnation every rank registers with (kv_transfer_config.engine_id; "" when the
    # config has none: `engine_id_of`), the connector's client's `engine_id`, so also sent with
    # every query, Load and Save: the server refuses a rank, and the requests, of another engine
    # under this instance id.
    engine_id: str = ""
    # The save gate's longest wait (pegaflow.save_gate_ms / PEGAFLOW_SAVE_GATE_MS; 0 = off: a step's
    # Save is sent as soon as its KV is written; None = worker_core.SAVE_GATE_S).
    save_gate_ms: Optional[int] = None

    @classmethod
    def from_vllm(cls, vllm_config: Any, env: Optional[Dict[str, str]] = None) -> "ConnectorSettings":
        e = os.environ if env is None else env
        kt = vllm_config.kv_transfer_config
        extra = dict(getattr(kt, "kv_connector_extra_config", None) or {})

        def get(key: str, var: str) -> Optional[str]:
            v = extra.get("pegaflow." + key)
            return str(v) if v is not None else e.get(var)

        def count(key: str, var: str) -> Optional[int]:
            """A non-negative integer setting, or None when it is not set."""
            v = get(key, var)
            if v is None:
                return None
            if not v.isdigit():
                raise ValueError(f"pegaflow.{key} {v!r} is not a non-negative integer")
            return int(v)

        def ms(key: str) -> Optional[int]:
            v = extra.get("pegaflow." + key)
            if v is None:
                return None
            # JSON gives an int (or a float, a string): a whole number of ms, > 0, or a clear error
            # ("5s" once failed with int()'s own message, and 2.5 became 2 ms).
            if isinstance(v, bool) or not (
                (isinstance(v, int) and v > 0)
                or (isinstance(v, float) and v.is_integer() and v > 0)
                or (isinstance(v, str) and v.isdigit() and int(v) > 0)
            ):
                raise ValueError(f"pegaflow.{key} {v!r} is not a whole number of milliseconds > 0")
            return int(v)

        mode = get("mode", "PEGAFLOW_MODE") or LAYERWISE
        if mode not in MODES:
            raise ValueError(f"pegaflow.mode {mode!r} is not one of {MODES}")
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        namespace = get("namespace", "PEGAFLOW_NAMESPACE") or derive_namespace(
            model=str(mc.model),
            dtype=str(mc.dtype),
            tp_size=pc.tensor_parallel_size,
            pp_size=pc.pipeline_parallel_size,
            num_kv_heads=mc.get_num_kv_heads(pc),
            head_size=mc.get_head_size(),
            num_layers=_total_layers(mc, pc),
            block_size=cc.block_size,
            cache_dtype=str(cc.cache_dtype),
            layout="mla" if getattr(mc, "use_mla", False) else "kv",
        )
        instance = get("instance_id", "PEGAFLOW_INSTANCE_ID") or getattr(kt, "engine_id", None)
        if not instance:
            # Scheduler and workers must agree without talking: fall back to something both derive.
            instance = "engine-" + namespace
            log.warning("no engine_id / pegaflow.instance_id: using %s (one engine per namespace per server)", instance)
        client = ClientConfig.resolve(
            addr=get("addr", "PEGAFLOW_ADDR"),
            rpc_timeout_ms=ms("rpc_timeout_ms"),
            save_timeout_ms=ms("save_timeout_ms"),
            load_timeout_ms=ms("load_timeout_ms"),
            reconnect_max_ms=ms("reconnect_max_ms"),
            env=e,
        )
        gpu_waits = (get("gpu_waits", "PEGAFLOW_GPU_WAITS") or "1").lower()
        if gpu_waits not in ("0", "1", "true", "false"):
            raise ValueError(f"pegaflow.gpu_waits {gpu_waits!r} is not one of 1, 0, true, false")
        load_issuer = get("load_issuer", "PEGAFLOW_LOAD_ISSUER") or default_load_issuer(vllm_config)
        if load_issuer not in LOAD_ISSUERS:
            raise ValueError(f"pegaflow.load_issuer {load_issuer!r} is not one of {LOAD_ISSUERS}")
        if load_issuer != ISSUER_WORKER and default_load_issuer(vllm_config) == ISSUER_WORKER:
            log.warning(
                "pegaflow.load_issuer %r assumes an engine that schedules one step at a time "
                "(docs/python.md, safety rule), but scheduler_config.async_scheduling=%s, "
                "pipeline_parallel_size=%s: its loads may fail (their state unlinked before the step's "
                "workers attach; recomputed) or land in blocks an earlier step still uses. Start vLLM "
                "with --no-async-scheduling (one pipeline stage), or use pegaflow.load_issuer=worker",
                load_issuer, getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", None),
                vllm_config.parallel_config.pipeline_parallel_size,
            )
        wait_ms = count("loading_wait_ms", "PEGAFLOW_LOADING_WAIT_MS")
        if wait_ms is not None and wait_ms > MAX_PREFETCH_WAIT_MS:
            raise ValueError(
                f"pegaflow.loading_wait_ms {wait_ms} is above {MAX_PREFETCH_WAIT_MS} (the server's longest hold)"
            )
        return cls(
            mode=mode, instance_id=safe_name(str(instance)), namespace=safe_name(namespace), client=client,
            load_issuer=load_issuer, device_id=count("device_id", "PEGAFLOW_DEVICE_ID"),
            staging_blocks=count("staging_blocks", "PEGAFLOW_STAGING_BLOCKS") or 0,
            gpu_waits=gpu_waits in ("1", "true"),
            loading_retry_ms=count("loading_retry_ms", "PEGAFLOW_LOADING_RETRY_MS"), engine_id=engine_id_of(kt),
            save_gate_ms=count("save_gate_ms", "PEGAFLOW_SAVE_GATE_MS"),
            loading_wait_ms=wait_ms,
        )


def engine_id_of(kt: Any) -> str:
    """The engine incarnation id the ranks register with: vLLM's `kv_transfer_config.engine_id`
    (a uuid4 vLLM makes once per engine, in `KVTransferConfig.__post_init__`, and pickles to every
    worker with the config). A config without one (None, or no such attribute: not vLLM's) gives
    "": the server does not check it. Every rank must send the same id without talking, and an id
    made up here would be made once per process: each worker unpickles its own copy of the config,
    so a TP rank of the engine would be refused as another engine's, and the engine would run
    without PegaFlow. (A single rank is still refused while another engine holds it.)"""
    eid = getattr(kt, "engine_id", None)
    if eid:
        return str(eid)
    log.warning(
        "kv_transfer_config has no engine_id: the ranks register without one, so the server cannot "
        "refuse another engine's rank under this instance id; give the config an engine_id"
    )
    return ""


def _total_layers(mc: Any, pc: Any) -> int:
    """The model's layer count, the same in every process of the engine. vLLM's
    `ModelConfig.get_num_layers(pc)` is this process's pipeline stage's share, from
    `pc.rank` (vllm/config/model.py `get_layers_start_end_indices`), and stages differ
    when the layers do not split evenly: their namespaces would differ, and the server
    refuses a rank of an instance registered under another namespace."""
    total = getattr(mc, "get_total_num_hidden_layers", None)
    if callable(total):
        return int(total())
    n = getattr(getattr(mc, "hf_text_config", None), "num_hidden_layers", None)
    if n is not None:
        return int(n)
    return mc.get_num_layers(pc) * pc.pipeline_parallel_size  # an even split (no vLLM fields to ask)


def default_load_issuer(vllm_config: Any) -> str:
    """"scheduler" only where vLLM's config says the engine schedules one
    step at a time: async scheduling explicitly off, and one pipeline stage
    (vLLM's executors report max_concurrent_batches = 2 with async scheduling,
    else pipeline_parallel_size — vllm/v1/executor/multiproc_executor.py — and
    the engine core keeps that many batches in flight, so step N+1 is
    scheduled while step N runs). Anything else, including a config that does
    not say: "worker"."""
    sc = getattr(vllm_config, "scheduler_config", None)
    if getattr(sc, "async_scheduling", None) is not False:
        return ISSUER_WORKER
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        return ISSUER_WORKER
    return ISSUER_SCHEDULER


def _ranks(vllm_config: Any) -> Tuple[int, int]:
    """(tp_rank, pp_rank) of this worker: vLLM's process groups when they exist,
    else ParallelConfig.rank (vLLM orders ranks TP-innermost)."""
    pc = vllm_config.parallel_config
    if HAVE_VLLM:
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank  # type: ignore

            return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        except (ImportError, AssertionError, AttributeError):
            pass
    rank = int(getattr(pc, "rank", 0))
    return rank % pc.tensor_parallel_size, rank // pc.tensor_parallel_size


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuses, naming why, what the connector cannot store correctly: more than one KV cache
    group (hybrid attention: each group has its own block table, and a save names group 0's
    block ids for every layer), and context parallelism (a block's KV is split over ranks and
    hashed per `block_size * cp` tokens), and a KV cache whose new blocks vLLM zeroes (Mamba
    state). Raises ValueError."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) > 1:
        raise ValueError(
            f"PegaflowConnector stores one KV cache group; this model has {len(groups)} "
            f"(hybrid attention: {[len(g.layer_names) for g in groups]} layers each), which it does not support"
        )
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        # vLLM zeroes newly allocated blocks of such models (Mamba state) in the step that
        # runs them: a load issued before that step would be wiped.
        raise ValueError(
            "PegaflowConnector stores attention KV only; this model's KV cache needs zeroing of new "
            "blocks (Mamba state), which it does not support"
        )
    pc = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        n = int(getattr(pc, name, 1) or 1)
        if n > 1:
            raise ValueError(f"PegaflowConnector does not support context parallelism ({name}={n})")


class PegaflowConnector(KVConnectorBase_V1):
    """vLLM KV connector v1 over PegaFlow; one instance per role and process.

    Modes (kv_connector_extra_config "pegaflow.mode"):
      layerwise  the Load is submitted in start_load_kv; wait_for_layer_load(layer)
                 returns as soon as that layer landed, so layer i computes while
                 later layers still copy (the request stays RUNNING)
      async      get_num_new_matched_tokens answers load_async=True; the whole
                 load runs between steps and completes through get_finished
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        self.settings = ConnectorSettings.from_vllm(vllm_config)
        # Every registration, query, Load and Save of this engine carries its engine id.
        self.client = PegaflowClient(config=self.settings.client, engine_id=self.settings.engine_id)
        self._scheduler: Optional[SchedulerCore] = None
        self._worker: Optional[WorkerCore] = None
        self._layer_hooks = False  # has_connector_metadata
        pc = vllm_config.parallel_config
        if role == KVConnectorRole.SCHEDULER:
            # vLLM orders ranks TP-innermost; the scheduler loads into every one.
            ranks = [
                (tp, pp) for pp in range(pc.pipeline_parallel_size) for tp in range(pc.tensor_parallel_size)
            ]
            self._scheduler = SchedulerCore(
                self.client, instance_id=self.settings.instance_id,
                block_size=vllm_config.cache_config.block_size, mode=self.settings.mode,
                load_issuer=self.settings.load_issuer, ranks=ranks,
                staging_blocks=self.settings.staging_blocks,
                loading_retry_s=(
                    LOADING_RETRY_MAX_S if self.settings.loading_retry_ms is None
                    else self.settings.loading_retry_ms / 1000.0
                ),
                loading_wait_ms=(
                    LOADING_WAIT_MS if self.settings.loading_wait_ms is None else self.settings.loading_wait_ms
                ),
            )
        else:
            tp_rank, pp_rank = _ranks(vllm_config)
            self._worker = WorkerCore(
                self.client, instance_id=self.settings.instance_id, namespace=self.settings.namespace,
                tp_rank=tp_rank, tp_size=pc.tensor_parallel_size, pp_rank=pp_rank,
                pp_size=pc.pipeline_parallel_size, mode=self.settings.mode,
                load_timeout_s=self.settings.client.load_timeout_s, device_id=self.settings.device_id,
                staging_blocks=self.settings.staging_blocks, gpu_waits=self.settings.gpu_waits,
                save_gate_s=SAVE_GATE_S if self.settings.save_gate_ms is None else self.settings.save_gate_ms / 1000.0,
            )
            if self.settings.mode == LAYERWISE:
                # Called once per layer per step (from vLLM's attention op): straight to the
                # worker, without this class's wrapper frames.
                self.wait_for_layer_load = self._worker.wait_for_layer_load  # type: ignore[method-assign]

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        mode = (extra_config or {}).get("pegaflow.mode") or os.environ.get("PEGAFLOW_MODE") or LAYERWISE
        return mode == LAYERWISE  # wait_for_layer_load must run between graph pieces

    def _w(self) -> WorkerCore:
        if self._worker is None:
            raise RuntimeError("worker-side method called on the scheduler-side connector")
        return self._worker

    def _s(self) -> SchedulerCore:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on the worker-side connector")
        return self._scheduler

    # ---- worker side ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._w().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, PegaflowConnectorMetadata):
            self._w().handle_preemptions(kv_connector_metadata.plan.preempted)
        elif isinstance(kv_connector_metadata, (set, frozenset, list)):  # older vLLM passed the ids
            self._w().handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        plan = connector_metadata.plan
        self._w().bind(plan)
        self._layer_hooks = self.settings.mode == LAYERWISE and bool(plan.loads)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._w().unbind()
        self._layer_hooks = False

    def has_connector_metadata(self) -> bool:
        """vLLM's gate for the per-layer hooks (`maybe_transfer_kv_layer` calls
        `wait_for_layer_load` and `save_kv_layer` around every attention op only when this is
        True). They do work only in a layer-wise step with loads (saves go in one Save after
        the step), so this is True for such a step alone: a decode step skips 2 calls per layer.
        vLLM calls every other hook whatever this answers."""
        return self._layer_hooks

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._w().start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A layer-wise worker never gets here: __init__ binds its WorkerCore's method in place of
        # this one (one frame per layer). Async mode loads between steps (the worker returns at once).
        self._w().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # All layers are saved by one Save after the step (wait_for_save), which
        # also keeps saves working under CUDA-graph replay where this is skipped.
        return None

    def wait_for_save(self) -> None:
        self._w().wait_for_save()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return self._w().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._w().take_load_errors()

    def pegaflow_stats(self) -> Dict[str, int]:
        """Counters: queries, hits, loads, load failures, saves, dropped saves, reconnects."""
        if self._worker is not None:
            return self._worker.stats_snapshot()
        return self._s().stats_snapshot()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        self.client.close()

    # ---- scheduler side -------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._s().update_state_after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PegaflowConnectorMetadata:
        n = scheduler_output.num_scheduled_tokens
        sched = [
            ScheduledRequest(r.req_id, r.block_ids[0], True, r.num_computed_tokens, n.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        c = scheduler_output.scheduled_cached_reqs
        resumed = getattr(c, "resumed_req_ids", None)
        if resumed is None:  # older vLLM: a bool per request
            flags = getattr(c, "resumed_from_preemption", None) or [False] * len(c.req_ids)
            resumed = {rid for rid, f in zip(c.req_ids, flags) if f}
        # The running requests (most of a decode step's): plain tuples of ScheduledRequest's fields.
        sched.extend(
            (rid, new[0] if new else None, rid in resumed, computed, n.get(rid, 0))
            for rid, new, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens)
        )
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        return PegaflowConnectorMetadata(self._s().build_step(sched, sorted(preempted)))

    def request_finished(self, request: Any, block_ids: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._s().request_finished(request), None

    def update_connector_output(self, connector_output: Any) -> None:
        s = self._s()
        # The failed loads first: an async load's failure comes with or before its finished_recving.
        s.load_errors(getattr(connector_output, "invalid_block_ids", None) or ())
        s.finished_sending(connector_output.finished_sending or ())
        s.finished_recving(connector_output.finished_recving or ())


__all__ = ["PegaflowConnector", "PegaflowConnectorMetadata", "ConnectorSettings", "HAVE_VLLM", "ASYNC", "LAYERWISE"]
