"""Stand-ins for the vLLM classes a KV connector touches, with vLLM's names and defaults.

vLLM cannot be installed on the machines this project is built and tested on, so the
connector (`pegaflow.connector.vllm`) imports vLLM's own classes when vLLM is present and
these otherwise, and our vLLM-shaped engine (`pegaflow.minivllm`) drives it through them.
Every class names the vLLM file it mirrors (vllm-project/vllm, read at 003df296 for
`kv_connector/v1/base.py`, 00e8f1fd for `v1/core/sched/output.py`). Only the members a
connector or the engine uses are mirrored; where vLLM has more, the docstring says so.
Drift from vLLM is reviewed here, in one file.

Example:
    >>> cfg = VllmConfig(kv_transfer_config=KVTransferConfig(
    ...     kv_connector="PegaflowConnector", kv_role="kv_both",
    ...     kv_connector_extra_config={"pegaflow.mode": "layerwise"}))
    >>> cfg.kv_transfer_config.get_from_extra_config("pegaflow.mode", "async")
    'layerwise'
"""

from __future__ import annotations

import enum
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "CacheConfig",
    "CachedRequestData",
    "ForwardContext",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "KVTransferConfig",
    "ModelConfig",
    "NewRequestData",
    "ParallelConfig",
    "RequestStatus",
    "SchedulerConfig",
    "SchedulerOutput",
    "SupportsHMA",
    "VllmConfig",
]


# --------------------------------------------------------------------------------------
# vllm/config/kv_transfer.py, model.py, cache.py, parallel.py, vllm.py
# --------------------------------------------------------------------------------------


@dataclass
class KVTransferConfig:
    """Mirrors `vllm.config.KVTransferConfig` (vllm/config/kv_transfer.py).

    `kv_role` is one of "kv_producer", "kv_consumer", "kv_both"; a cache is "kv_both".
    `engine_id` left None becomes a fresh uuid4, as vLLM's `__post_init__` makes it: one id
    per engine, which vLLM pickles to every worker with the config (`pegaflow.minivllm`, whose
    ranks build their own configs, hands its driver's to them).
    """

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cuda"
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in (
            "kv_producer",
            "kv_consumer",
            "kv_both",
        )

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class ModelConfig:
    """The part of `vllm.config.ModelConfig` (vllm/config/model.py) a connector reads.

    vLLM derives these from the HF config; here they are given. `dtype` is the torch dtype
    of the weights and (with `CacheConfig.cache_dtype == "auto"`) of the KV cache.
    """

    model: str = "minivllm/tiny"
    dtype: Any = None
    num_layers: int = 1
    num_kv_heads: int = 1
    head_size: int = 1
    hidden_size: int = 1
    max_model_len: int = 131072
    use_mla: bool = False

    def get_total_num_hidden_layers(self) -> int:
        return self.num_layers

    def get_num_layers(self, parallel_config: ParallelConfig) -> int:
        """This process's pipeline stage's layers, as vLLM counts them (the stage from
        `parallel_config.rank`, ranks TP-innermost): an uneven split gives one more layer to
        each of the stages before the last, from the last-but-one backwards."""
        pp = parallel_config.pipeline_parallel_size
        stage = (parallel_config.rank // parallel_config.tensor_parallel_size) % pp
        base, extra = divmod(self.num_layers, pp)
        return base + (1 if pp - 1 - extra <= stage < pp - 1 else 0)

    def get_total_num_kv_heads(self) -> int:
        return self.num_kv_heads

    def get_num_kv_heads(self, parallel_config: ParallelConfig) -> int:
        return max(1, self.num_kv_heads // parallel_config.tensor_parallel_size)

    def get_head_size(self) -> int:
        return self.head_size


@dataclass
class CacheConfig:
    """Mirrors `vllm.config.CacheConfig` (vllm/config/cache.py), the fields a connector reads."""

    block_size: int = 16
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks: int | None = None


@dataclass
class ParallelConfig:
    """Mirrors `vllm.config.ParallelConfig` (vllm/config/parallel.py): sizes and this rank."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    rank: int = 0


@dataclass
class SchedulerConfig:
    """The part of `vllm.config.SchedulerConfig` (vllm/config/scheduler.py) a connector reads.

    `async_scheduling`: vLLM schedules step N+1 while step N runs when True. Newer vLLM
    leaves it None until it decides; None here means "not known", which the connector
    treats like True. An engine that schedules synchronously says False.
    """

    async_scheduling: bool | None = None


@dataclass
class VllmConfig:
    """Mirrors `vllm.config.VllmConfig` (vllm/config/vllm.py): the configs a connector sees."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer_config: KVTransferConfig | None = None


# --------------------------------------------------------------------------------------
# vllm/v1/kv_cache_interface.py
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FullAttentionSpec:
    """Mirrors `vllm.v1.kv_cache_interface.FullAttentionSpec` (one layer's KV per block)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any

    @property
    def page_size_bytes(self) -> int:
        import torch

        esize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * esize


@dataclass
class KVCacheGroupSpec:
    """Mirrors `vllm.v1.kv_cache_interface.KVCacheGroupSpec`: layers sharing one block table."""

    layer_names: list[str]
    kv_cache_spec: FullAttentionSpec


@dataclass
class KVCacheConfig:
    """Mirrors `vllm.v1.kv_cache_interface.KVCacheConfig` (without `kv_cache_tensors`)."""

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)


# --------------------------------------------------------------------------------------
# vllm/v1/request.py
# --------------------------------------------------------------------------------------


class RequestStatus(enum.IntEnum):
    """Mirrors `vllm.v1.request.RequestStatus`; the FINISHED_* members sort after the rest."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


# --------------------------------------------------------------------------------------
# vllm/v1/core/kv_cache_utils.py, vllm/v1/core/kv_cache_manager.py
# --------------------------------------------------------------------------------------


class KVCacheBlock:
    """Mirrors `vllm.v1.core.kv_cache_utils.KVCacheBlock`: one physical block of every layer.

    `block_hash` is set while the block is full and in the prefix cache; `is_null` marks
    block 0, which vLLM reserves and never hands out.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


@dataclass
class KVCacheBlocks:
    """Mirrors `vllm.v1.core.kv_cache_manager.KVCacheBlocks`: blocks per KV cache group."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "only one group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks))
        )


# --------------------------------------------------------------------------------------
# vllm/v1/core/sched/output.py
# --------------------------------------------------------------------------------------


@dataclass
class NewRequestData:
    """Mirrors `vllm.v1.core.sched.output.NewRequestData` (no multimodal, LoRA, pooling)."""

    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    sampling_params: Any = None
    mm_features: list[Any] = field(default_factory=list)
    pooling_params: Any = None
    lora_request: Any = None


@dataclass
class CachedRequestData:
    """Mirrors `vllm.v1.core.sched.output.CachedRequestData`.

    For ids in `resumed_req_ids`, `new_block_ids` replaces the request's blocks (it came
    back from preemption); otherwise it is appended.
    """

    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls([], set(), [], {}, [], [], [])


@dataclass
class SchedulerOutput:
    """Mirrors `vllm.v1.core.sched.output.SchedulerOutput` (no encoder / spec-decode data).

    vLLM ships it to the workers pickled; so does `pegaflow.minivllm`.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    num_common_prefix_blocks: list[int] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    preempted_req_ids: set[str] | None = None
    # True when a request was scheduled this step with external tokens loaded synchronously
    # (vLLM 2aac565c): the worker then calls start_load_kv before the forward, else after.
    has_sync_kv_loads: bool = False
    kv_connector_metadata: KVConnectorMetadata | None = None

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0)


# --------------------------------------------------------------------------------------
# vllm/v1/outputs.py, vllm/forward_context.py
# --------------------------------------------------------------------------------------


@dataclass
class KVConnectorOutput:
    """Mirrors `vllm.v1.outputs.KVConnectorOutput`: what the workers' connectors report."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: KVConnectorWorkerMetadata | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    expected_finished_count: int = 0

    def is_empty(self) -> bool:
        return (
            not self.finished_sending
            and not self.finished_recving
            and not self.kv_connector_stats
            and not self.kv_cache_events
            and not self.invalid_block_ids
        )


@dataclass
class ForwardContext:
    """Mirrors `vllm.forward_context.ForwardContext`: what `start_load_kv` receives.

    `attn_metadata` maps layer name → that layer's attention metadata (None while no
    forward runs); `no_compile_layers` maps layer name → the attention module.
    """

    no_compile_layers: dict[str, Any] = field(default_factory=dict)
    attn_metadata: dict[str, Any] | None = None
    virtual_engine: int = 0


# --------------------------------------------------------------------------------------
# vllm/distributed/kv_transfer/kv_connector/v1/base.py
# --------------------------------------------------------------------------------------


class KVConnectorRole(enum.Enum):
    """Mirrors `KVConnectorRole`: SCHEDULER runs in the engine core, WORKER per GPU worker."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024 (vLLM's is an empty ABC too)
    """Mirrors `KVConnectorHandshakeMetadata`: out-of-band P/D handshake data; must pickle."""


class KVConnectorMetadata(ABC):  # noqa: B024
    """Mirrors `KVConnectorMetadata`: scheduler connector → worker connector, per step.

    It crosses a process boundary in vLLM, so it must survive `pickle`.
    """


class KVConnectorWorkerMetadata(ABC):
    """Mirrors `KVConnectorWorkerMetadata`: worker connector → scheduler connector."""

    @abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Combine this worker's metadata with another worker's for one step."""


class SupportsHMA(ABC):
    """Mirrors `SupportsHMA`: the connector handles hybrid-memory-allocator block groups."""

    @abstractmethod
    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Like `request_finished`, with the block ids of every KV cache group."""
        raise NotImplementedError


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    """Mirrors `KVConnectorBase_V1`: the methods vLLM calls, with the base class's defaults.

    Abstract methods (as in vLLM: a subclass missing one cannot be instantiated) raise
    NotImplementedError when called through `super()`; optional ones return what vLLM's
    base returns. The per-step call order is in `pegaflow.minivllm` (docs/minivllm.md).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    @property
    def supports_eagle_prefix_cache_hashing(self) -> bool:
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return self._kv_transfer_config.is_kv_producer

    # ---------------------------------------------------------------- worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata is bound"
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return None

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        return None

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        return None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        return None

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        raise NotImplementedError

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        raise NotImplementedError

    @abstractmethod
    def wait_for_save(self) -> None:
        raise NotImplementedError

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        return None

    def get_kv_connector_stats(self) -> Any:
        return None

    def get_kv_connector_kv_cache_events(self) -> Any:
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None

    # ------------------------------------------------------------- scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        return None

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        raise NotImplementedError

    @abstractmethod
    def update_state_after_alloc(
        self, request: Any, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        raise NotImplementedError

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        raise NotImplementedError

    def on_new_request(self, request: Any) -> None:
        return None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        return None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    def has_pending_push_work(self) -> bool:
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout is not callable on the abstract base")
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return False

    def get_finished_count(self) -> int | None:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        return None

    def reset_cache(self) -> bool | None:
        return None
