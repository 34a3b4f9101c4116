"""A KV connector test double that records every call the mini engine makes and acts as a
tiny in-process external KV cache, so tests can pin the engine's call order against vLLM's.

It is a double of *vLLM's connector contract*, not of PegaFlow: it lets the tests check that
the engine calls a connector in vLLM's order and handles its answers (hits, None, async
loads, load errors, delayed frees) the way vLLM's scheduler does.

Options (kv_connector_extra_config):
  "log": list            shared call log, entries (role, method, detail)
  "store": dict          hash → {layer name: (k bytes, v bytes)}, shared by both roles
  "mode": "sync"|"async" how hits are loaded
  "none_first": int      answer None this many times per request before answering
  "fail_loads": bool     loads leave the blocks untouched and report them as failed
  "delay_free": bool     request_finished keeps a request's blocks until its saves are reported
  "serve_hits": bool     answer hits at all (False: a save-only connector)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pegaflow.connector.vllm_api import (
    KVCacheBlocks,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SchedulerOutput,
)


@dataclass
class LoadSpec:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class SaveSpec:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class RecorderMeta(KVConnectorMetadata):
    step: int
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)


class RecordingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ex = self._kv_transfer_config.get_from_extra_config
        self.log: list = ex("log", [])
        self.store: dict = ex("store", {})
        self.mode: str = ex("mode", "sync")
        self.none_first: int = ex("none_first", 0)
        self.fail_loads: bool = ex("fail_loads", False)
        self.delay_free: bool = ex("delay_free", False)
        self.serve_hits: bool = ex("serve_hits", True)
        self.block_size = vllm_config.cache_config.block_size
        self.tag = "S" if role == KVConnectorRole.SCHEDULER else "W"
        # scheduler side
        self._requests: dict[str, Any] = {}
        self._none_answers: dict[str, int] = {}
        self._local: dict[str, int] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._pending_loads: list[LoadSpec] = []
        self._saved_blocks: dict[str, int] = {}
        self._step = 0
        self.built_metas: list[RecorderMeta] = []
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._saving: set[str] = set()
        self._has_saves: set[str] = set()
        self.bound_metas: list[RecorderMeta] = []

    def _rec(self, method: str, detail: Any = None) -> None:
        self.log.append((self.tag, method, detail))

    # ------------------------------------------------------------- scheduler side

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request
        self._rec("on_new_request", request.request_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        rid = request.request_id
        if self._none_answers.get(rid, 0) < self.none_first:
            self._none_answers[rid] = self._none_answers.get(rid, 0) + 1
            self._rec("get_num_new_matched_tokens", (rid, num_computed_tokens, None))
            return None, False
        first = num_computed_tokens // self.block_size
        hits = 0
        if self.serve_hits:
            for h in request.block_hashes[first:]:
                if h not in self.store:
                    break
                hits += 1
        tokens = min(hits * self.block_size, request.num_tokens - 1 - num_computed_tokens)
        tokens = max(tokens, 0)
        self._rec("get_num_new_matched_tokens", (rid, num_computed_tokens, tokens))
        self._local[rid] = num_computed_tokens
        return tokens, (self.mode == "async" and tokens > 0)

    def update_state_after_alloc(self, request: Any, blocks: KVCacheBlocks, num_external_tokens: int):
        rid = request.request_id
        self._rec("update_state_after_alloc", (rid, num_external_tokens))
        if num_external_tokens == 0:
            return
        (block_ids,) = blocks.get_block_ids()
        first = self._local[rid] // self.block_size
        n = -(-num_external_tokens // self.block_size)
        self._pending_loads.append(
            LoadSpec(rid, block_ids[first : first + n], request.block_hashes[first : first + n])
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        meta = RecorderMeta(self._step, loads=self._pending_loads)
        self._pending_loads = []
        meta.preempted_req_ids = set(scheduler_output.preempted_req_ids or ())
        for rid in meta.preempted_req_ids:
            self._saved_blocks.pop(rid, None)
        # Block tables as a real connector keeps them: from the scheduler output alone.
        sched = []
        for n in scheduler_output.scheduled_new_reqs:
            self._block_ids[n.req_id] = list(n.block_ids[0])
            sched.append((n.req_id, n.num_computed_tokens))
        c = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            new = list(c.new_block_ids[i][0]) if c.new_block_ids[i] else []
            if rid in c.resumed_req_ids:
                self._block_ids[rid] = new
            else:
                self._block_ids[rid].extend(new)
            sched.append((rid, c.num_computed_tokens[i]))
        for rid, computed in sched:
            req = self._requests[rid]
            end = computed + scheduler_output.num_scheduled_tokens[rid]
            full = min(end // self.block_size, len(req.block_hashes))
            done = self._saved_blocks.get(rid, 0)
            if full > done:
                ids = self._block_ids[rid]
                meta.saves.append(SaveSpec(rid, ids[done:full], req.block_hashes[done:full]))
                self._saved_blocks[rid] = full
        self.built_metas.append(meta)
        self._rec("build_connector_meta", (self._step, len(meta.loads), len(meta.saves)))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._rec(
            "update_connector_output",
            (
                sorted(connector_output.finished_sending or ()),
                sorted(connector_output.finished_recving or ()),
                sorted(connector_output.invalid_block_ids),
            ),
        )

    def request_finished(self, request: Any, block_ids: list[int]):
        rid = request.request_id
        delay = self.delay_free and self._saved_blocks.get(rid, 0) > 0
        self._rec("request_finished", (rid, delay))
        self._saved_blocks.pop(rid, None)
        self._requests.pop(rid, None)
        self._block_ids.pop(rid, None)
        return delay, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self._rec("register_kv_caches", list(kv_caches))

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._rec("handle_preemptions", sorted(kv_connector_metadata.preempted_req_ids))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.bound_metas.append(connector_metadata)
        self._rec("bind_connector_metadata", connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._rec("start_load_kv", [ld.req_id for ld in meta.loads])
        for ld in meta.loads:
            if self.fail_loads:
                self._load_errors.update(ld.block_ids)
            else:
                for bid, h in zip(ld.block_ids, ld.hashes):
                    for name, t in self.kv_caches.items():
                        k, v = self.store[h][name]
                        t[0, bid].copy_(k)
                        t[1, bid].copy_(v)
            if self.mode == "async":
                self._recving.add(ld.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._rec("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert kv_layer is self.kv_caches[layer_name], f"save_kv_layer got another tensor for {layer_name}"
        self._rec("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        self._rec("wait_for_save", [s.req_id for s in meta.saves])
        for s in meta.saves:
            self._has_saves.add(s.req_id)
            for bid, h in zip(s.block_ids, s.hashes):
                if h in self.store:
                    continue
                self.store[h] = {
                    name: (t[0, bid].clone(), t[1, bid].clone()) for name, t in self.kv_caches.items()
                }

    def get_finished(self, finished_req_ids: set[str]):
        self._rec("get_finished", sorted(finished_req_ids))
        sending = None
        if self.delay_free:
            self._saving |= finished_req_ids & self._has_saves
            # Saves are synchronous here: report them one call later, as an async save would.
            sending = {r for r in self._saving if r not in finished_req_ids} or None
            if sending:
                self._saving -= sending
                self._has_saves -= sending
        recving, self._recving = (self._recving or None), set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        self._rec("get_block_ids_with_load_errors", sorted(errs))
        return errs

    def get_kv_connector_stats(self):
        self._rec("get_kv_connector_stats")
        return None

    def get_kv_connector_kv_cache_events(self):
        self._rec("get_kv_connector_kv_cache_events")
        return None

    def build_connector_worker_meta(self):
        self._rec("build_connector_worker_meta")
        return None

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._rec("clear_connector_metadata")
