"""`LLMEngine`: a scheduler and a model runner joined the way vLLM's engine core joins them.

The scheduler → worker hand-off (`SchedulerOutput`, with the connector's metadata inside) and
the worker → scheduler reply (`ModelRunnerOutput`) both go through `pickle.dumps/loads`, as
they cross a process boundary in vLLM: a connector whose metadata does not pickle fails here
as it would there. The connector is two instances of one class, roles SCHEDULER and WORKER,
built from a `KVTransferConfig` like vLLM's factory does (`kv_connector` names the class,
`kv_connector_module_path` its module), or from a class given directly.

Tensor parallelism: with `tensor_parallel_size` > 1 the engine runs as that many processes,
one per rank, in a `torch.distributed` group the caller initialised (gloo on the CPU, NCCL on
GPUs), as vLLM's multiprocess executor does: rank 0 is the driver (scheduler, scheduler-side
connector, the API below), every rank has a model shard (llama.py), its own slice of the KV cache
and its own worker-side connector registering that rank, under the driver's
`kv_transfer_config.engine_id` (one engine, one engine id, as vLLM pickles one config to all its
workers). Each step the driver broadcasts the `SchedulerOutput`, every rank runs it, and the
driver gathers the ranks' connector outputs (a request has finished sending or receiving once
every rank says so, vLLM's KVOutputAggregator). The other ranks call `run_worker()`, which serves
the driver until it shuts down.

Example:
    >>> eng = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64))
    >>> out = eng.generate([list(range(40))], max_tokens=2)
    >>> len(out[0].output_token_ids)
    2
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from pegaflow.connector.vllm_api import (
    CacheConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVConnectorBase_V1,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from pegaflow.connector.vllm_api import SchedulerConfig as VllmSchedulerConfig
from pegaflow.minivllm.kv_cache_manager import KVCacheManager
from pegaflow.minivllm.llama import CONFIGS, LlamaConfig, LlamaModel
from pegaflow.minivllm.model_runner import KVCacheAllocator, ModelRunner
from pegaflow.minivllm.outputs import ModelRunnerOutput, RequestOutput
from pegaflow.minivllm.request import Request
from pegaflow.minivllm.scheduler import Scheduler, SchedulerConfig

__all__ = ["EngineConfig", "LLMEngine"]


@dataclass
class EngineConfig:
    model: str | LlamaConfig = "tiny"
    num_gpu_blocks: int = 256
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    device: str = "cpu"
    seed: int = 0
    kv_transfer_config: KVTransferConfig | None = None
    record_timeline: bool = False
    # Extra salt of the block hashes (same salt ⇔ same keys, across processes).
    hash_salt: str = ""
    # Tensor parallelism: this process is rank `tp_rank` of `tensor_parallel_size` (the
    # torch.distributed default group, initialised by the caller, is the TP group).
    tensor_parallel_size: int = 1
    tp_rank: int = 0
    extra: dict = field(default_factory=dict)

    def llama(self) -> LlamaConfig:
        if isinstance(self.model, LlamaConfig):
            return self.model
        if self.model not in CONFIGS:
            raise ValueError(f"unknown model config {self.model!r}; known: {sorted(CONFIGS)}")
        return CONFIGS[self.model]


def _connector_class(ktc: KVTransferConfig) -> type[KVConnectorBase_V1]:
    if not ktc.kv_connector or not ktc.kv_connector_module_path:
        raise ValueError(
            "kv_transfer_config needs kv_connector (class name) and kv_connector_module_path "
            f"(module), got {ktc.kv_connector!r} in {ktc.kv_connector_module_path!r}"
        )
    cls = getattr(importlib.import_module(ktc.kv_connector_module_path), ktc.kv_connector, None)
    if cls is None:
        raise ValueError(f"{ktc.kv_connector_module_path} has no {ktc.kv_connector}")
    return cls


def _driver_engine_id(ktc: KVTransferConfig | None, tp: int) -> KVTransferConfig | None:
    """The transfer config every rank's connector is built from, with the driver's engine id.
    vLLM makes one config (its `engine_id` a uuid4 unless given) and pickles it to every worker;
    here each rank builds its own, whose default uuid4s differ, so rank 0 hands its engine id to
    the others (a collective: every rank calls it at the same point of its start). One engine,
    one engine id: the server refuses a rank registering with another one."""
    if tp <= 1:
        return ktc
    box = [ktc.engine_id if ktc is not None else None]
    dist.broadcast_object_list(box, src=0)
    if ktc is None or ktc.engine_id == box[0]:
        return ktc
    return dataclasses.replace(ktc, engine_id=box[0])


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        connector_cls: type[KVConnectorBase_V1] | None = None,
        kv_cache_allocator: KVCacheAllocator | None = None,
        model: LlamaModel | None = None,
    ) -> None:
        self.config = config
        cfg = config.llama()
        self.model_config = cfg
        tp, rank = config.tensor_parallel_size, config.tp_rank
        if tp > 1 and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == tp):
            raise RuntimeError(
                f"tensor_parallel_size {tp}: initialise torch.distributed with {tp} ranks first "
                "(this process is one of them)"
            )
        if tp > 1 and dist.get_rank() != rank:
            raise ValueError(f"tp_rank {rank} but this process is torch.distributed rank {dist.get_rank()}")
        self.model = model or LlamaModel(cfg, config.device, config.seed, tp_rank=rank, tp_size=tp)
        if (self.model.tp_rank, self.model.tp_size) != (rank, tp):
            raise ValueError(
                f"the model is TP rank {self.model.tp_rank} of {self.model.tp_size}; the engine is {rank} of {tp}"
            )
        self.is_driver = rank == 0
        ktc = _driver_engine_id(config.kv_transfer_config, tp)
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=f"minivllm/{cfg.name}",
                dtype=cfg.torch_dtype,
                num_layers=cfg.num_layers,
                num_kv_heads=cfg.num_kv_heads,
                head_size=cfg.head_dim,
                hidden_size=cfg.hidden_size,
                max_model_len=cfg.max_model_len,
            ),
            cache_config=CacheConfig(
                block_size=cfg.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                num_gpu_blocks=config.num_gpu_blocks,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank),
            # One step at a time: the previous step's forward ended before schedule() runs.
            scheduler_config=VllmSchedulerConfig(async_scheduling=False),
            kv_transfer_config=ktc,
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=config.num_gpu_blocks,
            kv_cache_groups=[
                KVCacheGroupSpec(
                    [cfg.layer_name(i) for i in range(cfg.num_layers)],
                    FullAttentionSpec(cfg.block_size, self.model.kv_heads, cfg.head_dim, cfg.torch_dtype),
                )
            ],
        )
        worker_conn = sched_conn = None
        if connector_cls is None and ktc is not None and ktc.kv_connector:
            connector_cls = _connector_class(ktc)
        if connector_cls is not None:
            if ktc is None:
                raise ValueError("a connector needs EngineConfig.kv_transfer_config")
            # vLLM builds the workers (KV allocated, caches registered) before the scheduler.
            worker_conn = connector_cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.runner = ModelRunner(
            self.model,
            config.num_gpu_blocks,
            worker_conn,
            kv_cache_allocator,
            record_timeline=config.record_timeline,
        )
        self.worker_connector = worker_conn
        self.scheduler_connector = None
        self._aggregator = _KVOutputAggregator(tp)
        self._stopped = False
        if not self.is_driver:
            return  # a TP worker: run_worker() executes what the driver schedules
        if connector_cls is not None:
            sched_conn = connector_cls(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.scheduler_connector = sched_conn
        self.kv_cache_manager = KVCacheManager(
            config.num_gpu_blocks,
            cfg.block_size,
            enable_caching=config.enable_prefix_caching,
            max_model_len=cfg.max_model_len,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens,
                config.max_num_seqs,
                config.enable_chunked_prefill,
                cfg.max_model_len,
            ),
            self.kv_cache_manager,
            sched_conn,
        )
        self.last_runner_output: ModelRunnerOutput | None = None
        # Block table of each request scheduled in the last step that ran a forward.
        self.last_block_tables: dict[str, list[int]] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ API

    def add_request(
        self,
        prompt_token_ids: list[int],
        *,
        request_id: str | None = None,
        max_tokens: int = 1,
        eos_token_id: int | None = None,
    ) -> Request:
        """Queue a request; its TTFT clock starts now."""
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        vocab = self.model_config.vocab_size
        bad = None
        if prompt_token_ids and not (min(prompt_token_ids) >= 0 and max(prompt_token_ids) < vocab):
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)  # min/max: C speed on 10K tokens
        if bad is not None:
            raise ValueError(f"request {request_id}: token id {bad} outside vocabulary [0, {vocab})")
        req = Request(
            request_id,
            prompt_token_ids,
            max_tokens=max_tokens,
            block_size=self.model_config.block_size,
            eos_token_id=eos_token_id,
            hash_salt=self.config.hash_salt,
        )
        self.scheduler.add_request(req)
        return req

    def step(self) -> list[RequestOutput]:
        t_sched = time.perf_counter()
        so = self.scheduler.schedule()
        t_scheduled = time.perf_counter()
        if so.total_num_scheduled_tokens > 0:
            self.last_block_tables = {
                rid: self.kv_cache_manager.get_block_ids(rid)[0] for rid in so.num_scheduled_tokens
            }
        if self.config.tensor_parallel_size > 1:
            back = self._step_ranks(so)
        else:
            worker_so = pickle.loads(pickle.dumps(so))
            runner_out = self.runner.execute_model(worker_so)
            logits, timeline = runner_out.logits, runner_out.timeline
            runner_out.logits, runner_out.timeline = {}, None
            back = pickle.loads(pickle.dumps(runner_out))
            back.logits, back.timeline = logits, timeline
        if back.phases is not None:
            back.phases.update(schedule_start=t_sched, scheduled=t_scheduled)
        if so.total_num_scheduled_tokens > 0:
            self.last_runner_output = back
        outputs = self.scheduler.update_from_output(so, back)
        if back.phases is not None:
            back.phases["updated"] = time.perf_counter()
        if so.total_num_scheduled_tokens == 0 and not outputs:
            time.sleep(0.0002)  # only waiting on transfers: do not spin a core the server needs
        return outputs

    # ------------------------------------------------------------------ tensor parallel

    def _broadcast(self, msg: tuple) -> tuple:
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any] | None:
        out = [None] * self.config.tensor_parallel_size if self.is_driver else None
        dist.gather_object(obj, out, dst=0)
        return out

    def _step_ranks(self, so: Any) -> ModelRunnerOutput:
        """Driver: every rank runs `so`; the connector outputs are aggregated over the ranks."""
        self._broadcast(("step", so))  # pickled on the way, as between vLLM's processes
        own = self.runner.execute_model(pickle.loads(pickle.dumps(so)))
        outs = self._gather(_stripped(own))
        own.kv_connector_output = self._aggregator.aggregate([o.kv_connector_output for o in outs])
        return own

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Driver: runs `method(*args)` of every rank's model runner (vLLM's collective_rpc);
        returns each rank's answer, by rank."""
        if not self.is_driver:
            raise RuntimeError("collective_rpc is called on the driver (tp_rank 0)")
        if self.config.tensor_parallel_size == 1:
            return [getattr(self.runner, method)(*args)]
        self._broadcast(("rpc", method, args))
        return self._gather(getattr(self.runner, method)(*args))

    def run_worker(self) -> None:
        """A TP rank other than 0: runs what the driver sends until it shuts down."""
        if self.is_driver:
            raise RuntimeError("run_worker is for tp_rank > 0; the driver steps the engine")
        while True:
            msg = self._broadcast(("",))
            if msg[0] == "step":
                self._gather(_stripped(self.runner.execute_model(msg[1])))
            elif msg[0] == "rpc":
                self._gather(getattr(self.runner, msg[1])(*msg[2]))
            else:
                break
        self._shutdown_connectors()

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int = 1,
        timeout_s: float = 300.0,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; the final output of each, in order."""
        reqs = [self.add_request(p, max_tokens=max_tokens) for p in prompts]
        final: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + timeout_s
        while len(final) < len(reqs):
            if time.monotonic() > deadline:
                pending = [r.request_id for r in reqs if r.request_id not in final]
                raise TimeoutError(f"generate: {pending} unfinished after {timeout_s} s")
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r.request_id] for r in reqs]

    def drain(self, timeout_s: float = 60.0) -> None:
        """Step until no request runs and the connector holds no finished request's blocks."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_work():
            if time.monotonic() > deadline:
                s = self.scheduler
                left = {
                    "running": [r.request_id for r in s.running],
                    "waiting": [f"{r.request_id} ({r.status.name})" for r in (*s.skipped_waiting, *s.waiting)],
                    "delayed frees": [rid for rid, r in s.requests.items() if r.is_finished()],
                }
                raise TimeoutError(
                    f"drain: unfinished after {timeout_s} s: "
                    + "; ".join(f"{k} {v}" for k, v in left.items() if v)
                )
            self.step()

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> bool:
        """Forget the GPU prefix cache, after the connector released every finished request."""
        self.drain(timeout_s)
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Driver: stops the TP workers too. Idempotent."""
        if self.is_driver and self.config.tensor_parallel_size > 1 and not self._stopped:
            self._stopped = True
            self._broadcast(("stop",))
        self._shutdown_connectors()

    def _shutdown_connectors(self) -> None:
        for conn in (self.scheduler_connector, self.worker_connector):
            if conn is not None:
                conn.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _stripped(out: ModelRunnerOutput) -> ModelRunnerOutput:
    """What a rank sends the driver: the output without the device-side logits and timeline."""
    return ModelRunnerOutput(
        req_ids=out.req_ids,
        req_id_to_index=out.req_id_to_index,
        sampled_token_ids=out.sampled_token_ids,
        kv_connector_output=out.kv_connector_output,
        sampled_time=out.sampled_time,
    )


class _KVOutputAggregator:
    """vLLM's KVOutputAggregator: a request has finished sending (receiving) once every rank
    reported it, over however many steps that takes; invalid blocks are the union."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()

    def _count(self, seen: Counter[str], ids: set[str] | None) -> set[str]:
        done = set()
        for rid in ids or ():
            seen[rid] += 1
            if seen[rid] == self.world:
                del seen[rid]
                done.add(rid)
        return done

    def aggregate(self, outs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        present = [o for o in outs if o is not None]
        if not present:
            return None
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        for o in present:
            sending |= self._count(self._sending, o.finished_sending)
            recving |= self._count(self._recving, o.finished_recving)
            invalid |= set(o.invalid_block_ids or ())
        first = present[0]
        return KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            invalid_block_ids=invalid,
            kv_connector_stats=first.kv_connector_stats,
            kv_cache_events=first.kv_cache_events,
            kv_connector_worker_meta=first.kv_connector_worker_meta,
        )
