"""A minimal vLLM-shaped driver for the connector tests: a scheduler that
calls the scheduler-side connector as vllm/v1/core/sched/scheduler.py does
(docs/minivllm.md has the order) and a model runner that calls the worker-side connector
in ActiveKVConnector's order, with a tiny fake "model" writing known bytes.

The fake model: the K (seg 0) / V (seg 1) of token position p in layer l is
a function of the token prefix tokens[:p+1] (as real KV is), so a loaded
block must be byte-equal to what a cold run computed. Before a layer's
"attention" it checks that every earlier position of the request already
holds its expected bytes — the property layer-wise loading must give.
(pegaflow.minivllm is the full engine with a real torch model; this is the
small, fast harness the unit suite needs.)
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

import grpc
import numpy as np
import torch

from pegaflow.connector.vllm import PegaflowConnector
from pegaflow.connector.vllm_api import (
    CacheConfig,
    CachedRequestData,
    ForwardContext,
    KVCacheBlock,
    KVCacheBlocks,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    ModelConfig,
    NewRequestData,
    ParallelConfig,
    SchedulerOutput,
    VllmConfig,
)
from pegaflow.errors import PegaflowError
from pegaflow.hashes import chained_block_hashes, synthetic_tokens
from pegaflow.regions import ShmRegion

from waits import wait_for

BLOCK = 4
HEADS, HEAD_DIM, LAYERS = 2, 8, 3
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def token_kv(tokens: List[int], p: int, layer: int, seg: int) -> torch.Tensor:
    d = hashlib.sha256(np.asarray(tokens[: p + 1], dtype="<u4").tobytes() + bytes([layer, seg])).digest()
    rng = np.random.default_rng(int.from_bytes(d[:8], "little"))
    return torch.from_numpy(rng.standard_normal((HEADS, HEAD_DIM)).astype(np.float16))


@dataclass
class Request:
    """The vLLM Request fields the connector reads."""

    request_id: str
    prompt_token_ids: List[int]
    salt: str
    num_computed_tokens: int = 0
    block_ids: List[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_hashes(self) -> List[bytes]:
        return chained_block_hashes(self.prompt_token_ids, BLOCK, self.salt)


def vllm_config(addr: str, instance: str, model: str, mode: str, **extra) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype=torch.float16, num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD_DIM),
        cache_config=CacheConfig(block_size=BLOCK),
        parallel_config=ParallelConfig(),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PegaflowConnector", engine_id=instance, kv_role="kv_both",
            kv_connector_module_path="pegaflow.connector.vllm",
            kv_connector_extra_config={"pegaflow.addr": addr, "pegaflow.mode": mode, **extra},
        ),
    )


class Engine:
    """Scheduler connector + worker connector + a KV cache in one shm region."""

    def __init__(self, cfg: VllmConfig, num_blocks: int = 32):
        self.cfg = cfg
        self.mode = cfg.kv_transfer_config.kv_connector_extra_config["pegaflow.mode"]
        self.sched = PegaflowConnector(cfg, KVConnectorRole.SCHEDULER, None)
        self.worker = PegaflowConnector(cfg, KVConnectorRole.WORKER, None)
        per_layer = 2 * num_blocks * BLOCK * HEADS * HEAD_DIM * 2
        self.region = ShmRegion(per_layer * LAYERS)
        self.kv: Dict[str, torch.Tensor] = {
            n: self.region.torch(torch.float16, (2, num_blocks, BLOCK, HEADS, HEAD_DIM), offset=i * per_layer)
            for i, n in enumerate(LAYER_NAMES)
        }
        self.worker.register_kv_caches(self.kv)
        self.free = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.finished_ids: Set[str] = set()  # finished since the last step (SchedulerOutput.finished_req_ids)
        self.delayed: Dict[str, Request] = {}
        self.layer_violations: List[str] = []
        self.invalid_blocks: Set[int] = set()
        self.last_output: Optional[KVConnectorOutput] = None

    # ---- scheduler ----

    def admit(self, req: Request, avoid: Set[int] = frozenset()) -> Optional[int]:
        """schedule() for a WAITING request: the connector probe (twice: it must
        be side-effect free), allocation, update_state_after_alloc. Returns the
        external tokens, or None when the connector said "ask again"."""
        n, load_async = self.sched.get_num_new_matched_tokens(req, req.num_computed_tokens)
        again = self.sched.get_num_new_matched_tokens(req, req.num_computed_tokens)
        assert again == (n, load_async), "get_num_new_matched_tokens must be side-effect free"
        if n is None:
            return None
        need = -(-req.num_tokens // BLOCK)
        picks = [b for b in self.free if b not in avoid][:need]
        for b in picks:
            self.free.remove(b)
        req.block_ids = picks
        blocks = KVCacheBlocks(([KVCacheBlock(b) for b in picks],))
        self.sched.update_state_after_alloc(req, blocks, n)
        req.num_external = n
        req.load_async = load_async
        return n

    def _output(self, new: List[Request], cached: List[Request] = (), sched_tokens: Dict[str, int] = None, preempted=()) -> SchedulerOutput:
        out = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(r.request_id, r.prompt_token_ids, (list(r.block_ids),), r.num_computed_tokens) for r in new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in cached], resumed_req_ids=set(), new_token_ids=[[] for _ in cached],
                all_token_ids={}, new_block_ids=[None for _ in cached],
                num_computed_tokens=[r.num_computed_tokens for r in cached], num_output_tokens=[0 for _ in cached],
            ),
            num_scheduled_tokens=dict(sched_tokens or {}),
            total_num_scheduled_tokens=sum((sched_tokens or {}).values()),
            finished_req_ids=set(self.finished_ids),
            preempted_req_ids=set(preempted),
        )
        self.finished_ids.clear()
        meta = self.sched.build_connector_meta(out)
        out.kv_connector_metadata = pickle.loads(pickle.dumps(meta))  # crosses a process in vLLM
        return out

    # ---- worker (ActiveKVConnector's order) ----

    def _step(self, out: SchedulerOutput, compute: Dict[str, Request]) -> KVConnectorOutput:
        w = self.worker
        meta = out.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(ForwardContext())
        for li, name in enumerate(LAYER_NAMES):
            if compute:
                w.wait_for_layer_load(name)
            for rid, req in compute.items():
                start, end = req.num_computed_tokens, req.num_computed_tokens + out.num_scheduled_tokens[rid]
                # "attention" reads every earlier position: it must hold the right KV now
                if self.mode == "layerwise":
                    for p in range(start):
                        if not self._holds(req, p, li):
                            self.layer_violations.append(f"{rid} layer {li} pos {p}")
                            break
                for p in range(start, end):
                    b, off = req.block_ids[p // BLOCK], p % BLOCK
                    for s in range(2):
                        self.kv[name][s, b, off] = token_kv(req.prompt_token_ids, p, li, s)
                w.save_kv_layer(name, self.kv[name], None)
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        res = KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=errors)
        self.sched.update_connector_output(res)
        self.invalid_blocks |= errors
        for rid in sending or ():
            self._free(self.delayed.pop(rid))
        self.last_output = res
        return res

    def _holds(self, req: Request, p: int, layer: int) -> bool:
        b, off = req.block_ids[p // BLOCK], p % BLOCK
        name = LAYER_NAMES[layer]
        return all(
            torch.equal(self.kv[name][s, b, off], token_kv(req.prompt_token_ids, p, layer, s)) for s in range(2)
        )

    def holds_all(self, req: Request, upto: int) -> bool:
        return all(self._holds(req, p, l) for p in range(upto) for l in range(LAYERS))

    def _free(self, req: Request) -> None:
        self.free.extend(req.block_ids)

    def idle_step(self) -> KVConnectorOutput:
        return self._step(self._output([]), {})

    def run_prefill(self, req: Request, avoid: Set[int] = frozenset(), max_steps: int = 200) -> int:
        """Admits and prefills `req` the way vLLM's loop would; returns the external tokens."""
        n = None
        for _ in range(max_steps):
            n = self.admit(req, avoid)
            if n is not None:
                break
            self.idle_step()
        assert n is not None, "connector kept answering None"
        if n and req.load_async:
            # WAITING_FOR_REMOTE_KVS: not scheduled; steps run until finished_recving names it.
            out = self._output([])
            res = self._step(out, {})
            for _ in range(max_steps):
                if res.finished_recving and req.request_id in res.finished_recving:
                    break
                time.sleep(0.005)  # a scheduler-issued Load may still be on its way to the server
                res = self.idle_step()
            else:
                raise AssertionError("async load never finished")
            bad = sorted(self.invalid_blocks & set(req.block_ids))
            if bad:  # _handle_invalid_blocks: truncate at the first bad block
                n = min(n, req.block_ids.index(bad[0]) * BLOCK)
            blocks = KVCacheBlocks(([KVCacheBlock(b) for b in req.block_ids],))
            self.sched.update_state_after_alloc(req, blocks, 0)
        req.num_computed_tokens = n
        todo = req.num_tokens - n
        out = self._output([req], sched_tokens={req.request_id: todo})
        res = self._step(out, {req.request_id: req})
        bad = sorted(res.invalid_block_ids & set(req.block_ids))
        if bad and not req.load_async:
            # sync load failed: vLLM truncates num_computed_tokens and recomputes
            first = req.block_ids.index(bad[0]) * BLOCK
            req.num_computed_tokens = first
            out = self._output([], cached=[req], sched_tokens={req.request_id: req.num_tokens - first})
            self._step(out, {req.request_id: req})
        req.num_computed_tokens = req.num_tokens
        return n

    def finish(self, req: Request) -> bool:
        """Request done: request_finished; True = blocks held until finished_sending."""
        delay, params = self.sched.request_finished(req, list(req.block_ids))
        assert params is None
        self.finished_ids.add(req.request_id)
        if delay:
            self.delayed[req.request_id] = req
        else:
            self._free(req)
        return delay

    def drain(self, rid: str, steps: int = 1000) -> None:
        """Idle steps (as vLLM's loop keeps stepping) until `rid`'s blocks are freed."""
        for _ in range(steps):
            if rid not in self.delayed:
                return
            self.idle_step()
            time.sleep(0.005)
        raise AssertionError(f"{rid} never came back in finished_sending")

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()
        self.region.close()


def lose_leases_after_alloc(eng: "Engine") -> None:
    """From now on every lease is given back right after the scheduler allocated for it, before
    the worker's Load (as when a lease expired): that Load is refused and its blocks must be
    recomputed. For worker-issued loads (a scheduler-issued Load has consumed the lease already)."""
    core = eng.sched._s()
    real = core.update_state_after_alloc

    def alloc_then_lose_lease(req, block_ids, n):
        real(req, block_ids, n)
        for li in core._loads:
            eng.sched.client.release(li.lease_id)

    core.update_state_after_alloc = alloc_then_lose_lease


def lose_load_answers(eng: "Engine", issuer: str, gate: threading.Event) -> "tuple[List[str], Callable[[], None]]":
    """From now on every Load's answer is lost (DEADLINE_EXCEEDED at once) while the Load itself
    reaches the server late, once `gate` is set (its real answer ignored): the copy may land
    after the engine gave up on it. Returns the load-state names sent so far (appended as each
    late Load goes out) and a function that puts the real sends back. `issuer`: "worker" (the
    worker's Load) or "scheduler" (the scheduler's load_nowait)."""
    sent: List[str] = []
    lost = PegaflowError(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost by the test", "Load")

    def later(send: Callable[[], None], name: str) -> None:
        def go() -> None:
            gate.wait(30)
            sent.append(name)
            try:
                send()
            except PegaflowError:
                pass  # the load state carries what happened

        threading.Thread(target=go, daemon=True).start()

    if issuer == "worker":
        client = eng.worker._w().client
        real_load = client.load

        def late_load(**kw):
            later(lambda: real_load(**kw), kw["load_state_shm"])
            raise lost

        client.load = late_load
        return sent, lambda: setattr(client, "load", real_load)
    client = eng.sched._s().client
    real_send = client.load_nowait

    def late_send(*, on_done, **kw):
        later(lambda: real_send(on_done=lambda _e: None, **kw), kw["load_state_shm"])
        on_done(lost)

    client.load_nowait = late_send
    return sent, lambda: setattr(client, "load_nowait", real_send)


def saved_prompt(eng: "Engine", seed: int, salt: str, blocks: int = 5) -> "tuple[List[int], Set[int]]":
    """A prompt of `blocks` full blocks that request "a" prefilled, finished and saved (drained),
    and the blocks it used: the next request with this prefix hits it, and avoiding those blocks
    keeps their stale copy from passing for a load or a recompute."""
    prompt = synthetic_tokens(seed, blocks * BLOCK)
    a = Request("a", prompt, salt=salt)
    eng.run_prefill(a)
    eng.finish(a)
    eng.drain("a")
    return prompt, set(a.block_ids)


def wait_saved(eng: "Engine", timeout_s: float = 10.0) -> None:
    """Until the worker has no save queued or in flight (`timeout_s` at most)."""
    wc = eng.worker._w()
    wait_for(lambda: not wc._pending, "the worker's saves to finish", timeout_s=timeout_s)


def sealed(eng: "Engine", hashes: List[bytes]) -> int:
    """How many of `hashes`, from the first, the server holds sealed (the lease given back)."""
    q = eng.sched.client.query_prefetch(
        instance_id=eng.sched.settings.instance_id, block_hashes=hashes, request_id="check"
    )
    if q.lease_id:
        eng.sched.client.release(q.lease_id)
    return q.hits


def out_of_range_targets(call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (a client's load or load_nowait) with every target id past num_blocks: the server
    refuses the Load (INVALID_ARGUMENT) and leaves its lease as it was."""

    def refused(**kw: Any) -> Any:
        return call(**{**kw, "block_ids": [10**6] * len(kw["block_ids"])})

    return refused
