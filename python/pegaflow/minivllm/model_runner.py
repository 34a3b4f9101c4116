"""The worker: owns the paged KV cache and runs one step, calling the connector in vLLM's order.

Mirrors `vllm/v1/worker/gpu/kv_connector.py` (`ActiveKVConnector`, @ 00f4240e) and the attention
wrapper `maybe_transfer_kv_layer` (`model_executor/layers/attention/kv_transfer_utils.py`):

  init:  register_kv_caches({layer name: [2, num_blocks, block_size, kv_heads, head_dim]})
         (`set_host_xfer_buffer_ops` is not called: this engine has no host-buffer copy op)
  step:  handle_preemptions(meta) → bind_connector_metadata(meta)
         → start_load_kv(forward_context) here if scheduler_output.has_sync_kv_loads
         → per layer: wait_for_layer_load(name) → write K/V + attention → save_kv_layer(name, kv, meta)
         → start_load_kv(forward_context) here otherwise (async loads: off the critical path)
         → wait_for_save() → get_finished(finished_req_ids) → get_block_ids_with_load_errors()
         → get_kv_connector_stats() → get_kv_connector_kv_cache_events()
         → build_connector_worker_meta() → clear_connector_metadata()
         → sample (greedy); the token reaches the CPU.
  A step with no tokens scheduled still runs the connector part (vLLM's `no_forward`), so
  async loads get started and their completion polled; like vLLM's, without wait_for_save
  (`post_forward(..., wait_for_save=False)`: no forward wrote KV to save).

Without a connector the same runner is a plain engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pegaflow.connector.vllm_api import (
    ForwardContext,
    KVConnectorBase_V1,
    KVConnectorOutput,
    SchedulerOutput,
)
from pegaflow.minivllm.llama import LlamaModel, SeqInfo, StepBatch
from pegaflow.minivllm.outputs import LayerTiming, ModelRunnerOutput

__all__ = [
    "AttentionMetadata",
    "KVCacheAllocator",
    "ModelRunner",
    "default_kv_cache_allocator",
    "shm_kv_cache_allocator",
]

# (layer name, shape, dtype, device) → a zeroed tensor of that shape. The host backend of
# PegaFlow needs the KV cache inside shared-memory files, so allocation is pluggable.
KVCacheAllocator = Callable[[str, tuple, torch.dtype, torch.device], torch.Tensor]


def default_kv_cache_allocator(
    name: str, shape: tuple, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def shm_kv_cache_allocator(regions: list) -> KVCacheAllocator:
    """KV tensors inside shared-memory files, which PegaFlow's host backend maps by name (the
    device is ignored: the tensors are on the CPU). Each allocation's `ShmRegion` is appended to
    `regions`; the caller closes them once the engine is shut down."""
    from pegaflow.regions import ShmRegion

    def alloc(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        r, t = ShmRegion.holding(torch.empty((), dtype=dtype), shape)
        regions.append(r)
        return t

    return alloc


@dataclass
class AttentionMetadata:
    """What `save_kv_layer` receives (vLLM's FlashAttentionMetadata, the fields that matter)."""

    slot_mapping: torch.Tensor
    num_actual_tokens: int
    seq_lens: list[int]
    query_lens: list[int]
    req_ids: list[str]


@dataclass
class _ReqState:
    """The worker's copy of a request (vLLM's CachedRequestState)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        connector: KVConnectorBase_V1 | None = None,
        kv_cache_allocator: KVCacheAllocator | None = None,
        record_timeline: bool = False,
        load_then_compute: bool = False,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.cfg = cfg
        self.device = model.device
        self.block_size = cfg.block_size
        self.num_blocks = num_blocks
        self.connector = connector
        self.record_timeline = record_timeline
        # The step's host phases alone (a few clock reads: bench/ttft.py's decode splits each
        # step with them); the timeline records them too, with its per-layer GPU events.
        self.record_phases = False
        # Benchmark knob, not a vLLM behaviour: wait for every layer's load before the forward
        # starts (no overlap of load and compute), to measure what layer-wise load saves.
        self.load_then_compute = load_then_compute
        alloc = kv_cache_allocator or default_kv_cache_allocator
        shape = (2, num_blocks, cfg.block_size, model.kv_heads, cfg.head_dim)  # this rank's heads
        self.layer_names = [cfg.layer_name(i) for i in range(cfg.num_layers)]
        # ForwardContext.no_compile_layers: fixed for the engine's life, built once (start_load_kv
        # gets a context every step).
        self._no_compile_layers: dict[str, None] = dict.fromkeys(self.layer_names)
        # Insertion order is execution order (vLLM builds this dict from the model's layers).
        self.kv_caches: dict[str, torch.Tensor] = {}
        for name in self.layer_names:
            t = alloc(name, shape, cfg.torch_dtype, self.device)
            if tuple(t.shape) != shape or t.dtype != cfg.torch_dtype:
                raise ValueError(
                    f"kv_cache_allocator gave {name} shape {tuple(t.shape)} {t.dtype}, "
                    f"expected {shape} {cfg.torch_dtype}"
                )
            self.kv_caches[name] = t
        self._kv_list = list(self.kv_caches.values())
        self._kv_planes = [model.kv_planes(t) for t in self._kv_list]
        self.requests: dict[str, _ReqState] = {}
        self._pending_load = False
        if connector is not None:
            connector.register_kv_caches(self.kv_caches)

    # ------------------------------------------------------------------ inspection

    def kv_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """A copy of blocks `block_ids` of every layer's cache (this rank's heads), by layer."""
        return {name: t[:, block_ids].clone() for name, t in self.kv_caches.items()}

    def fill_kv(self, value: float) -> None:
        """Overwrites every layer's cache with `value` (tests: only a real load restores it)."""
        for t in self.kv_caches.values():
            t.fill_(value)

    # ------------------------------------------------------------------ state

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids or ():
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.prompt_token_ids is not None
            self.requests[new.req_id] = _ReqState(
                new.req_id,
                list(new.prompt_token_ids),
                len(new.prompt_token_ids),
                list(new.block_ids[0]),
                new.num_computed_tokens,
            )
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            new_blocks = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                tokens = list(c.all_token_ids[rid])
                self.requests[rid] = _ReqState(
                    rid,
                    tokens,
                    len(tokens) - c.num_output_tokens[i],
                    list(new_blocks[0]) if new_blocks else [],
                    c.num_computed_tokens[i],
                )
                continue
            st = self.requests[rid]
            if new_blocks:
                st.block_ids.extend(new_blocks[0])
            # A token sampled over a failed load was dropped by the scheduler: drop it here too.
            del st.token_ids[st.num_prompt_tokens + c.num_output_tokens[i] :]
            st.num_computed_tokens = c.num_computed_tokens[i]

    def _prepare(self, so: SchedulerOutput) -> tuple[StepBatch, list[str], AttentionMetadata]:
        """The step's flat token batch and attention indexes, built with numpy and copied to the
        device in one transfer; every layer reuses them."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        gathers: list[np.ndarray] = []
        tables: list[np.ndarray] = []
        seqs: list[SeqInfo] = []
        logits_rows: list[int] = []
        sample_ids: list[str] = []
        k_start = 0
        offs = np.arange(bs, dtype=np.int64)
        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests[rid]
            c = st.num_computed_tokens
            kv = c + n
            seqs.append(SeqInfo(len(ids), n, kv, k_start, c == 0))
            k_start += kv
            ids.extend(st.token_ids[c:kv])
            table = np.asarray(st.block_ids[: -(-kv // bs)], dtype=np.int64)
            # Every slot of the request's keys, context and new tokens, in position order.
            all_slots = (table[:, None] * bs + offs).reshape(-1)[:kv]
            gathers.append(all_slots)
            tables.append(table)
            slots.append(all_slots[c:])
            pos.append(np.arange(c, kv, dtype=np.int64))
            if kv >= len(st.token_ids):  # the step reaches the last token: sample
                logits_rows.append(len(ids) - 1)
                sample_ids.append(rid)
        t = len(ids)
        all_fresh = all(s.fresh for s in seqs)
        q_lens = np.asarray([s.q_len for s in seqs], dtype=np.int64)
        k_lens = q_lens if all_fresh else np.asarray([s.kv_len for s in seqs], dtype=np.int64)
        cu_q = np.concatenate([[0], np.cumsum(q_lens)])
        cu_k = np.concatenate([[0], np.cumsum(k_lens)])
        parts = [np.asarray(ids, dtype=np.int64), *pos, *slots, np.asarray(logits_rows, dtype=np.int64), cu_q, cu_k]
        # One sequence with a context gathers whole blocks (llama.py `_attention`).
        gather_blocks = not all_fresh and len(seqs) == 1
        if not all_fresh:
            parts += tables if gather_blocks else gathers
        flat = torch.from_numpy(np.concatenate(parts)).to(self.device)
        o = 3 * t + len(logits_rows)
        ns = len(seqs) + 1
        cu = flat[o : o + 2 * ns].to(torch.int32)
        batch = StepBatch(
            input_ids=flat[:t],
            positions=flat[t : 2 * t],
            slot_mapping=flat[2 * t : 3 * t],
            seqs=seqs,
            logits_indices=flat[3 * t : o],
            kv_gather=None if all_fresh else flat[o + 2 * ns :],
            gather_blocks=gather_blocks,
            cu_q=cu[:ns],
            cu_k=cu[ns:],
            max_q=int(q_lens.max()),
            max_k=int(k_lens.max()),
            spans=[(s.q_start, s.q_len, s.q_start if all_fresh else s.k_start, s.q_len if all_fresh else s.kv_len)
                   for s in seqs],  # fmt: skip
        )
        seq_lens = [s.kv_len for s in seqs]
        qlens = [s.q_len for s in seqs]
        meta = AttentionMetadata(batch.slot_mapping, t, seq_lens, qlens, list(so.num_scheduled_tokens))
        return batch, sample_ids, meta

    # ------------------------------------------------------------------ connector order

    def _forward_context(self, meta: AttentionMetadata | None) -> ForwardContext:
        return ForwardContext(
            no_compile_layers=self._no_compile_layers,
            attn_metadata=None if meta is None else dict.fromkeys(self.layer_names, meta),
        )

    def _pre_forward(self, so: SchedulerOutput, meta: AttentionMetadata | None) -> None:
        conn = self.connector
        assert conn is not None and so.kv_connector_metadata is not None
        conn.handle_preemptions(so.kv_connector_metadata)
        conn.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            conn.start_load_kv(self._forward_context(meta))
            if self.load_then_compute:
                for name in self.layer_names:
                    conn.wait_for_layer_load(name)
        else:
            self._pending_load = True

    def _post_forward(
        self, so: SchedulerOutput, meta: AttentionMetadata | None, wait_for_save: bool = True
    ) -> KVConnectorOutput:
        conn = self.connector
        assert conn is not None
        if self._pending_load:
            self._pending_load = False
            conn.start_load_kv(self._forward_context(meta))
        out = KVConnectorOutput()
        if wait_for_save:
            conn.wait_for_save()
        sending, recving = conn.get_finished(so.finished_req_ids)
        out.finished_sending = sending or None
        out.finished_recving = recving or None
        out.invalid_block_ids = set(conn.get_block_ids_with_load_errors())
        out.kv_connector_stats = conn.get_kv_connector_stats()
        out.kv_cache_events = conn.get_kv_connector_kv_cache_events()
        out.kv_connector_worker_meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        return out

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            if self.connector is None:
                return ModelRunnerOutput()
            self._pre_forward(so, None)
            return ModelRunnerOutput(kv_connector_output=self._post_forward(so, None, wait_for_save=False))
        clock = time.perf_counter if self.record_timeline or self.record_phases else None
        phases = {"runner_start": clock()} if clock else None
        batch, sample_ids, meta = self._prepare(so)
        if phases:
            phases["prepared"] = clock()
        if self.connector is not None:
            self._pre_forward(so, meta)
        if phases:
            phases["pre_forward_done"] = clock()
        hooks = _StepHooks(self, meta)
        hidden = self.model.forward(batch, self._kv_list, hooks if hooks.needed else None, self._kv_planes)
        if phases:
            phases["forward_launched"] = clock()
        kv_out = self._post_forward(so, meta) if self.connector is not None else None
        if phases:
            phases["post_forward_done"] = clock()
        for rid, n in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        logits = self.model.compute_logits(hidden)
        tokens = logits.argmax(dim=-1).tolist()  # the first token reaches the CPU here
        sampled_time = time.perf_counter()
        if phases:
            phases["sampled"] = sampled_time
        out = ModelRunnerOutput(
            phases=phases,
            req_ids=list(so.num_scheduled_tokens),
            req_id_to_index={rid: i for i, rid in enumerate(so.num_scheduled_tokens)},
            kv_connector_output=kv_out,
            sampled_time=sampled_time,
        )
        sampled = dict(zip(sample_ids, tokens))
        out.sampled_token_ids = [[sampled[r]] if r in sampled else [] for r in out.req_ids]
        for row, rid in enumerate(sample_ids):
            self.requests[rid].token_ids.append(sampled[rid])
            # A view on the model's device: no copy per request per step (a decode batch of 32
            # would move 16 MB to the host every step for nothing).
            out.logits[rid] = logits[row]
        out.timeline = hooks.timeline()
        return out


class _StepHooks:
    """The per-layer half of vLLM's connector order, plus the optional per-layer timeline."""

    def __init__(self, runner: ModelRunner, meta: AttentionMetadata) -> None:
        conn = runner.connector
        # vLLM skips the layer hooks when no metadata is bound (kv_transfer_utils.py); the
        # binding is fixed for the step, so it is looked up once, not per layer.
        self.conn = conn if conn is not None and conn.has_connector_metadata() else None
        self.names = runner.layer_names
        self.meta = meta
        self.record = runner.record_timeline
        self.cuda = runner.device.type == "cuda"
        self.needed = self.conn is not None or self.record
        n = len(self.names)
        if not self.record:
            # A step that is not timed: no timeline hooks, and the connector's two called
            # straight (a decode step is launch-bound). The methods below are the timed path.
            self.layer_begin = self.layer_end = None  # type: ignore[assignment]
            if self.conn is not None:
                wait, save, names = self.conn.wait_for_layer_load, self.conn.save_kv_layer, self.names
                self.pre_attention = lambda i: wait(names[i])  # type: ignore[method-assign]
                self.post_attention = lambda i, kv: save(names[i], kv, meta)  # type: ignore[method-assign]
        else:
            self.t0 = time.perf_counter()
            self.wait = [(0.0, 0.0)] * n
            if self.cuda:
                self.ev0 = torch.cuda.Event(enable_timing=True)
                self.ev0.record()
                self.ev = [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(n)
                ]
                # Around each layer's wait, on the stream: where the wait is the GPU's own
                # (connector/gpu_wait.py) the host does not block, and these tell when it passed.
                self.wait_ev = [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(n)
                ]
            else:
                self.cpu = [(0.0, 0.0)] * n

    def layer_begin(self, i: int) -> None:
        if self.cuda:
            self.ev[i][0].record()
        else:
            self.cpu[i] = (time.perf_counter(), 0.0)

    def pre_attention(self, i: int) -> None:
        t = time.perf_counter()
        if self.cuda:
            self.wait_ev[i][0].record()
        if self.conn is not None:
            self.conn.wait_for_layer_load(self.names[i])
        if self.cuda:
            self.wait_ev[i][1].record()
        self.wait[i] = (t, time.perf_counter())

    def post_attention(self, i: int, kv_cache: torch.Tensor) -> None:
        if self.conn is not None:
            self.conn.save_kv_layer(self.names[i], kv_cache, self.meta)

    def layer_end(self, i: int) -> None:
        if self.cuda:
            self.ev[i][1].record()
        else:
            self.cpu[i] = (self.cpu[i][0], time.perf_counter())

    def timeline(self) -> list[LayerTiming] | None:
        if not self.record:
            return None
        ms = 1e3
        out = []
        if self.cuda:
            torch.cuda.synchronize()
        for i in range(len(self.names)):
            if self.cuda:
                # On the GPU's clock (from ev0, recorded when the host was at t0): the wait ends
                # when the stream got past it, whether the host or the stream itself waited.
                ws = max(self.ev0.elapsed_time(self.wait_ev[i][0]), (self.wait[i][0] - self.t0) * ms)
                we = max(self.ev0.elapsed_time(self.wait_ev[i][1]), ws)
                cs = self.ev0.elapsed_time(self.ev[i][0])
                ce = self.ev0.elapsed_time(self.ev[i][1])
            else:
                ws, we = ((x - self.t0) * ms for x in self.wait[i])
                cs, ce = ((x - self.t0) * ms for x in self.cpu[i])
            out.append(LayerTiming(i, ws, we, cs, ce))
        return out
