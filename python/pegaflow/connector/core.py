"""Engine-agnostic state machines of a KV connector over PegaFlow: the
scheduler side decides what to load and save, the worker side moves the
bytes. Plain ids, hashes and picklable dataclasses cross between them (the
vLLM adapter in vllm.py only maps vLLM's objects onto these calls).

Scheduler side (`SchedulerCore`), per request:
  probe   get_num_new_matched_tokens → QueryPrefetch of the hashes past the
          locally computed prefix, capped so at least one token is computed.
          The answer and its lease are cached per request, so repeated calls
          are side-effect free; the lease is released when the probe drifts
          (a different computed prefix), is not used, or the request ends.
          "loading" (a lower tier is fetching) answers None: ask me later.
  load    update_state_after_alloc → a LoadIntent (lease + target block ids;
          fewer targets than hits load that prefix, the server gives the rest back).
          With load_issuer "scheduler" the Load of every TP/PP rank is sent right
          here, each with its own LoadState that this side creates; the names ride
          in the intent and each worker attaches to its rank's (no RPC).
          SAFETY RULE of the scheduler issuer: the copy starts before the workers
          run the step, so it is correct only when the engine schedules one step
          at a time (the previous forward ended before the scheduler runs: no
          kernel still reads or writes a block just reallocated to this request;
          and a step that preempts admits no new request, so a preempted
          request's pending saves were waited for by handle_preemptions first).
          vLLM's async scheduling and PP's batch queue break it: use "worker".
  save    build_step → SaveIntents for the blocks that become full in this
          step (their ids and the engine's own block hashes)
  finish  request_finished → delay the free while saves or a layer-wise load
          may be pending (the worker reports the id in finished_sending when none
          is), or while an async load has not come back in finished_recving.
Worker side (`WorkerCore`): registration (KvRegistration: survives server
restarts), Loads with a LoadState each (or attached to the scheduler's),
per-layer waits (layer-wise mode) or polling between steps (async mode), and
a save thread so a step never waits for a Save. A load that timed out may
still land: it keeps its request's blocks held (handle_preemptions waits for
it, finished_sending waits for it) until the server settles its state. Failures never raise into the engine: a query error is a miss,
a save error is a dropped save (counted), a load error lists the blocks in
`take_load_errors()` so the engine recomputes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple


from ..client import PegaflowClient, QueryResult
from ..errors import PegaflowError, PegaflowLoadError
from ..load_state import LoadState
from ..regions import export_kv_layers
from ..registration import KvRegistration
from .lifecycle import LINGER_LOAD_TIMEOUTS, MAYBE_ACCEPTED, FreshStates, unlink_shm
from .query_issuer import EarlyLoad, QueryIssuer
from .staging import StagingBuffers, StagingRoom, staging_instance

log = logging.getLogger("pegaflow.connector")

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
#: A cached probe is trusted for this fraction of its lease's TTL, then asked again.
PROBE_TTL_FRACTION = 0.5
_NAME_OK = re.compile(r"[^A-Za-z0-9._-]")
#: How often a wait that only lingering loads can end polls their states.
LINGER_POLL_S = 0.001


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
    """Save these full blocks of a request (ids + the engine's block hashes)."""

    request_id: str
    block_ids: List[int]
    block_hashes: List[bytes]


@dataclass
class StepPlan:
    """Everything the workers do for one step."""

    loads: List[LoadIntent] = field(default_factory=list)
    saves: List[SaveIntent] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)


@dataclass
class ScheduledRequest:
    """One request in a step's schedule: `block_ids` is its new blocks
    (appended) or, with `replace_blocks`, all of them (new or resumed)."""

    request_id: str
    block_ids: Optional[Sequence[int]]
    replace_blocks: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


# ---- scheduler side ----------------------------------------------------------


@dataclass
class _Probe:
    computed_blocks: int
    asked: int
    result: QueryResult
    at: float
    rid: str = ""
    # load_issuer "query": the hit's copy into staging blocks is already running.
    early: Optional[EarlyLoad] = None


@dataclass
class _Tracked:
    request: Any
    block_ids: List[int] = field(default_factory=list)
    saved_upto: int = 0
    had_save: bool = False
    had_load: bool = False  # layer-wise: the workers hold the blocks until the load settled


class SchedulerCore:
    """The scheduler-side state machine. `request` objects need
    `request_id`, `block_hashes` (list of bytes) and `num_tokens`;
    `num_publishable_block_hashes` is honoured when present.

    Example:
        core = SchedulerCore(client, instance_id="inst", block_size=16, mode="async")
        n, is_async = core.get_num_new_matched_tokens(req, 0)
        core.update_state_after_alloc(req, block_ids, n)
        plan = core.build_step([ScheduledRequest(...)], preempted=[])
    """

    def __init__(
        self,
        client: PegaflowClient,
        *,
        instance_id: str,
        block_size: int,
        mode: str = LAYERWISE,
        load_issuer: str = ISSUER_WORKER,
        ranks: Sequence[Tuple[int, int]] = ((0, 0),),
        staging_blocks: int = 0,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if load_issuer not in LOAD_ISSUERS:
            raise ValueError(f"load_issuer {load_issuer!r} is not one of {LOAD_ISSUERS}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must name each (tp_rank, pp_rank) of the instance once, got {list(ranks)}")
        self.client = client
        self.instance_id = instance_id
        self.block_size = block_size
        self.mode = mode
        self.load_issuer = load_issuer
        self.ranks = [tuple(r) for r in ranks]
        # Layer-wise loads go through the workers' staging blocks (staging.py) when they have
        # some: queries and Loads then name the staging instance, which holds the same blocks.
        self.staging: Optional[StagingRoom] = (
            StagingRoom(staging_blocks) if staging_blocks > 0 and mode == LAYERWISE else None
        )
        self.load_instance = staging_instance(instance_id) if self.staging else instance_id
        if load_issuer == ISSUER_QUERY and self.staging is None:
            raise ValueError(
                "load_issuer 'query' loads into staging blocks before the engine allocates: it needs "
                "layer-wise mode and pegaflow.staging_blocks > 0"
            )
        # Load states the scheduler-side issuers use, made between steps (lifecycle.py).
        self._fresh = FreshStates(0 if load_issuer == ISSUER_WORKER else len(self.ranks))
        self._query_issuer: Optional[QueryIssuer] = None
        if load_issuer == ISSUER_QUERY:
            self._query_issuer = QueryIssuer(
                client, self.staging, ranks=self.ranks, load_timeout_s=client.config.load_timeout_s,
                count=self._count, fresh=self._fresh,
            )
        self._probes: Dict[str, _Probe] = {}
        self._tracked: Dict[str, _Tracked] = {}
        self._loads: List[LoadIntent] = []
        self._delayed: Set[str] = set()
        # Async mode: requests whose load has not come back in finished_recving yet.
        self._loading: Set[str] = set()
        # Scheduler-issued load states not unlinked yet, by name → [answered,
        # step_ran] (see _issue); _issued: those of the plan being built.
        self._names: Dict[str, List[bool]] = {}
        self._issued: List[str] = []
        self._shipped: List[str] = []
        # Load answers arrive on gRPC threads: they count and unlink under this lock.
        self._stats_lock = threading.Lock()
        self.stats: Dict[str, int] = defaultdict(int)

    # -- probe --

    def _release(self, probe: Optional[_Probe]) -> None:
        if probe is None:
            return
        if probe.early is not None and self._query_issuer is not None:
            self._query_issuer.drop(probe.rid, probe.early)  # its lease was spent by the loads
            return
        if self.staging is not None:
            self.staging.unreserve(probe.result.hits)
        if not probe.result.lease_id:
            return
        try:
            self.client.release(probe.result.lease_id)
        except PegaflowError as e:  # it expires on its own; nothing to undo here
            self.stats["release_errors"] += 1
            log.debug("release failed: %s", e)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        rid = request.request_id
        self._tracked.setdefault(rid, _Tracked(request))
        bs = self.block_size
        hashes = request.block_hashes
        computed = num_computed_tokens // bs
        # At least the last token is computed by the engine (it needs its logits).
        loadable = min(len(hashes), max(0, (request.num_tokens - 1) // bs))
        asked = loadable - computed
        if asked <= 0:
            self._release(self._probes.pop(rid, None))
            return 0, False
        now = time.monotonic()
        p = self._probes.get(rid)
        if p is not None and (p.computed_blocks, p.asked) == (computed, asked) and (
            p.early is not None or now - p.at < p.result.ttl_ms / 1000.0 * PROBE_TTL_FRACTION
        ):
            return self._answer(p)
        self._release(self._probes.pop(rid, None))
        if self.staging is not None:
            # A load must fit the step's staging blocks: ask for no more than are left.
            loadable = computed + self.staging.offer(asked)
            if loadable <= computed:
                self.stats["staging_full"] += 1
                return 0, False
        self.stats["queries"] += 1
        early: Optional[EarlyLoad] = None
        try:
            if self._query_issuer is not None:
                q, early = self._query_issuer.query(rid, self.load_instance, hashes[computed:loadable])
            else:
                q = self.client.query_prefetch(
                    instance_id=self.load_instance, block_hashes=hashes[computed:loadable], request_id=rid
                )
        except PegaflowError as e:
            # Server away, instance not (yet) registered, ...: a miss, never an error in the step.
            self.stats["query_errors"] += 1
            log.debug("query for %s failed (answering 0 hits): %s", rid, e)
            return 0, False
        if q.loading:
            self.stats["query_loading"] += 1
            return None, False
        p = _Probe(computed, asked, q, now, rid, early)
        self._probes[rid] = p
        if self.staging is not None and early is None:
            self.staging.reserve(q.hits)
        self.stats["hit_blocks"] += q.hits
        return self._answer(p)

    def _answer(self, p: _Probe) -> Tuple[int, bool]:
        hits = p.result.hits
        return hits * self.block_size, hits > 0 and self.mode == ASYNC

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """`block_ids`: all of the request's blocks (group 0), local prefix first."""
        rid = request.request_id
        tr = self._tracked.setdefault(rid, _Tracked(request))
        p = self._probes.pop(rid, None)
        n = num_external_tokens // self.block_size
        if n <= 0 or p is None or not p.result.lease_id:
            self._release(p)
            return
        if n > p.result.hits:
            self._release(p)
            raise ValueError(
                f"request {rid}: {num_external_tokens} external tokens exceed the {p.result.hits} "
                f"blocks get_num_new_matched_tokens offered"
            )
        start = p.computed_blocks
        targets = list(block_ids[start:start + n])
        if len(targets) != n:
            self._release(p)
            raise ValueError(
                f"request {rid}: {len(block_ids)} blocks allocated, need blocks {start}..{start + n - 1} to load into"
            )
        if p.early is not None and self._query_issuer is not None:
            first, _ = self._query_issuer.claim(rid, p.early)
            intent = LoadIntent(rid, p.result.lease_id, list(range(first, first + n)), states=p.early.names,
                                scatter_to=targets)
            with self._stats_lock:
                for name in intent.states.values():
                    self._names[name] = [True, False]  # answered with the query; unlinked once its step ran
            self._issued.extend(intent.states.values())
        elif self.staging is not None:
            first = self.staging.take(n, reserved=p.result.hits)
            intent = LoadIntent(rid, p.result.lease_id, list(range(first, first + n)), scatter_to=targets)
        else:
            intent = LoadIntent(rid, p.result.lease_id, targets)
        if self.load_issuer == ISSUER_SCHEDULER:
            self._issue(intent)
        self._loads.append(intent)
        if self.mode == ASYNC:
            self._loading.add(rid)
        else:
            tr.had_load = True
        tr.saved_upto = max(tr.saved_upto, start + n)  # those blocks are held by the server already
        self.stats["load_intents"] += 1

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def _issue(self, intent: LoadIntent) -> None:
        """Sends the Load of every rank now, each with its own fresh load state,
        without waiting for the answers: the copy starts while the scheduler
        finishes the step and the workers prepare it. A refusal or a broken
        call marks that rank's state failed (the server also marks a refusal
        itself), so the rank's worker sees it like any failed load.

        Life of a state's name: created here; opened by the server when the
        Load arrives (before it answers); attached by the rank's worker in
        start_load_kv of the step whose plan carries it. Unlinked here once
        both are past: the Load was answered, and the next build_step ran (the
        engine schedules synchronously, so that step's workers have attached).
        Whichever comes second unlinks; close() unlinks the rest. Every mapping
        (ours until the answer, the server's, the worker's) outlives the name."""
        intent.states = {}
        for (tp_rank, pp_rank), st in zip(self.ranks, self._fresh.take(len(self.ranks))):
            # Handed over: the name is unlinked by the bookkeeping below, not by st.close().
            intent.states[(tp_rank, pp_rank)] = st.name
            with self._stats_lock:
                self._names[st.name] = [False, False]
            self._issued.append(st.name)

            def answered(err: Optional[PegaflowError], st: LoadState = st, rank=(tp_rank, pp_rank)) -> None:
                if err is not None:
                    st.mark_failed()
                    self._count("load_issue_errors")
                    log.warning(
                        "request %s: Load of tp_rank %d pp_rank %d failed (recomputed): %s",
                        intent.request_id, rank[0], rank[1], err,
                    )
                st.close()
                self._passed(st.name, 0)

            try:
                self.client.load_nowait(
                    instance_id=self.load_instance, tp_rank=tp_rank, pp_rank=pp_rank, lease_id=intent.lease_id,
                    block_ids=intent.block_ids, load_state_shm=st.name, request_id=intent.request_id,
                    on_done=answered,
                )
                self._count("loads_issued")
            except PegaflowError as e:  # the client is closed: nothing was sent
                answered(e)

    # -- step --

    def build_step(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()) -> StepPlan:
        plan = StepPlan(loads=self._loads, preempted=list(preempted))
        self._loads = []
        if self.staging is not None:
            self.staging.next_step()
        if self._query_issuer is not None:
            self._query_issuer.poll()
        self._fresh.refill()
        if self._shipped or self._issued:
            # The engine schedules synchronously (the rule of the scheduler
            # issuer): the step that carried these names has run.
            for name in self._shipped:
                self._passed(name, 1)
            self._shipped, self._issued = self._issued, []
        for rid in plan.preempted:
            tr = self._tracked.get(rid)
            if tr is not None:
                tr.block_ids = []  # freed; new ids come with the resumed schedule
        bs = self.block_size
        tracked = self._tracked
        for s in scheduled:
            tr = tracked.get(s.request_id)
            if tr is None:
                continue  # never probed: not ours to save
            if s.block_ids is None:
                pass
            elif s.replace_blocks:
                tr.block_ids = list(s.block_ids)
            elif s.block_ids:
                tr.block_ids.extend(s.block_ids)  # own list (intents copy their slices)
            if (s.num_computed_tokens + s.num_scheduled_tokens) // bs <= tr.saved_upto:
                continue  # no block completes in this step (most decode steps): nothing to save
            hashes = tr.request.block_hashes
            publishable = getattr(tr.request, "num_publishable_block_hashes", None)
            n_hash = len(hashes) if publishable is None else min(len(hashes), publishable)
            full = min((s.num_computed_tokens + s.num_scheduled_tokens) // bs, n_hash, len(tr.block_ids))
            if full > tr.saved_upto:
                plan.saves.append(
                    SaveIntent(s.request_id, tr.block_ids[tr.saved_upto:full], list(hashes[tr.saved_upto:full]))
                )
                tr.saved_upto = full
                tr.had_save = True
                self.stats["save_intents"] += 1
        return plan

    def _passed(self, name: str, event: int) -> None:
        """Event 0 (Load answered) or 1 (its step ran) of a state; the second unlinks it."""
        with self._stats_lock:
            marks = self._names.get(name)
            if marks is None:
                return
            marks[event] = True
            if not all(marks):
                return
            del self._names[name]
        unlink_shm(name)

    def request_finished(self, request: Any) -> bool:
        """True: keep the blocks until the id comes back in finished_sending
        (it had saves or a layer-wise load: each worker reports it once none of
        them is in flight) or, async mode, in finished_recving (its load may
        still be landing in them; the worker reports every async load it ran)."""
        rid = request.request_id
        self._release(self._probes.pop(rid, None))
        tr = self._tracked.pop(rid, None)
        if rid in self._loading or (tr is not None and (tr.had_save or tr.had_load)):
            self._delayed.add(rid)
            return True
        return False

    def finished_sending(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._delayed.discard(rid)

    def finished_recving(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            if rid in self._loading:
                self._loading.discard(rid)
                self._delayed.discard(rid)

    def stats_snapshot(self) -> Dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    @property
    def delayed(self) -> Set[str]:
        return set(self._delayed)

    def close(self) -> None:
        for p in self._probes.values():
            self._release(p)
        self._probes.clear()
        if self._query_issuer is not None:
            self._query_issuer.close()
        self._fresh.close()
        with self._stats_lock:
            names, self._names = list(self._names), {}
        for name in names:
            unlink_shm(name)
        self._shipped, self._issued = [], []


# ---- worker side --------------------------------------------------------------


def _tensor_key(t: Any) -> Tuple[int, Tuple[int, ...], Tuple[int, ...]]:
    """(data pointer, shape, strides): equal for two names of one KV tensor."""
    if hasattr(t, "data_ptr"):
        return t.data_ptr(), tuple(t.shape), tuple(t.stride())
    return t.__array_interface__["data"][0], tuple(t.shape), tuple(t.strides)


@dataclass
class _Load:
    intent: LoadIntent
    state: Optional[LoadState]
    failed: bool = False
    done: bool = False
    at: float = 0.0
    owned: bool = True  # created here (reusable); False: attached to the scheduler's
    timed_out: bool = False
    held: bool = False  # layer-wise: counted in its request's in-flight transfers
    lingering: bool = False
    index: Any = None  # staged: the request's blocks as the scatter's index
    scattered: int = 0  # staged: layers already scattered into the request's blocks


@dataclass
class _SaveJob:
    event: Any
    intents: List[SaveIntent]


class WorkerCore:
    """The worker-side state machine of one rank.

    Example:
        w = WorkerCore(client, instance_id="inst", namespace=ns, tp_rank=0, tp_size=1, mode="layerwise")
        w.register_kv_caches(kv_caches)          # dict order = execution order
        w.bind(plan); w.start_load()
        for name in layers: w.wait_for_layer_load(name); ...
        w.wait_for_save(); w.get_finished(finished_ids); w.take_load_errors(); w.unbind()
    """

    def __init__(
        self,
        client: PegaflowClient,
        *,
        instance_id: str,
        namespace: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        mode: str = LAYERWISE,
        load_timeout_s: Optional[float] = None,
        save_queue_depth: int = 64,
        device_id: Optional[int] = None,
        staging_blocks: int = 0,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if staging_blocks < 0:
            raise ValueError(f"staging_blocks must be >= 0, got {staging_blocks}")
        self.client = client
        # Layer-wise only (async loads span steps, so a step's staging run would not be free
        # at the next step): see staging.py.
        self.staging_blocks = staging_blocks if mode == LAYERWISE else 0
        if staging_blocks and mode != LAYERWISE:
            log.warning("pegaflow.staging_blocks=%d is ignored in %s mode (layer-wise only)", staging_blocks, mode)
        self.staging: Optional[StagingBuffers] = None
        self.staging_registration: Optional[KvRegistration] = None
        self.instance_id, self.namespace = instance_id, namespace
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, pp_rank, pp_size
        # The device this rank registers: CUDA KV names its own; host-backend KV (shm) has none,
        # so a server serving several devices (--devices 0,1) is told which one here.
        self.device_id = device_id
        self.mode = mode
        self.load_timeout_s = load_timeout_s if load_timeout_s is not None else client.config.load_timeout_s
        self.registration: Optional[KvRegistration] = None
        self._alias: Dict[str, str] = {}
        self._cuda = False
        self._plan: Optional[StepPlan] = None
        self._step_loads: List[_Load] = []  # layer-wise: this step's loads
        self._async_loads: Dict[str, _Load] = {}
        self._free_states: List[LoadState] = []
        self._errors: Set[int] = set()
        self._lock = threading.Condition()
        # request → its saves queued or in flight and its layer-wise loads not settled
        self._pending: Dict[str, int] = defaultdict(int)
        # requests with a save or a layer-wise load on this worker (reported in finished_sending)
        self._saving: Set[str] = set()
        self._lingering: List[_Load] = []  # timed-out loads whose copy may still land
        self._finishing: Set[str] = set()
        self._queue: "queue.Queue[Optional[_SaveJob]]" = queue.Queue(maxsize=save_queue_depth)
        self._thread: Optional[threading.Thread] = None
        self.stats: Dict[str, int] = defaultdict(int)

    # -- registration --

    def register_kv_caches(self, kv_caches: Mapping[str, Any], layout: Optional[str] = None) -> None:
        """Registers the layers in the mapping's order (= execution order). A
        layer that reuses an earlier layer's tensor (vLLM's KV sharing) is
        registered once, under the first name; the alias waits on that layer."""
        unique: Dict[str, Any] = {}
        first: Dict[Tuple[int, Tuple[int, ...], Tuple[int, ...]], str] = {}
        for name, t in kv_caches.items():
            key = _tensor_key(t)
            if key in first:
                self._alias[name] = first[key]
            else:
                first[key] = name
                unique[name] = t
        layers, device = export_kv_layers(unique, layout)
        self._cuda = any(bool(getattr(t, "is_cuda", False)) for t in unique.values())
        if self.device_id is not None:
            if self._cuda and device != self.device_id:
                raise ValueError(
                    f"tp_rank {self.tp_rank}: device_id {self.device_id} was configured but the KV "
                    f"tensors are on cuda:{device}"
                )
            device = self.device_id
        self.registration = self._register(self.instance_id, layers, device)
        if self.staging_blocks:
            self._register_staging(unique, layout, device)
        self._thread = threading.Thread(target=self._save_loop, name=f"pegaflow-save-{self.tp_rank}", daemon=True)
        self._thread.start()

    def _register_staging(self, unique: Mapping[str, Any], layout: Optional[str], device: int) -> None:
        """The staging blocks, registered as `<instance>.staging` in the same namespace (same
        layers, same rank): the server loads into them as into any instance's blocks."""
        self.staging = StagingBuffers(unique, self.staging_blocks, layout)
        layers, _ = export_kv_layers(self.staging.tensors, layout)
        self.staging_registration = self._register(staging_instance(self.instance_id), layers, device)

    def _register(self, instance_id: str, layers: Sequence[Any], device: int) -> KvRegistration:
        """Registers `layers` as this rank of `instance_id` (re-registered after a server restart)."""
        reg = KvRegistration(
            self.client, instance_id=instance_id, namespace=self.namespace, layers=layers,
            tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size,
            device_id=device,
        )
        reg.register()
        return reg

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:  # the save thread and the engine's thread both count
            self.stats[key] += n

    def _reg(self) -> KvRegistration:
        if self.registration is None:
            raise RuntimeError("register_kv_caches() was not called")
        return self.registration

    # -- per step --

    def bind(self, plan: StepPlan) -> None:
        self._plan = plan

    def unbind(self) -> None:
        self._plan = None

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        """Returns once no save of these requests is queued or in flight and
        no load into their blocks may still land (the blocks are about to be
        reused), or after the save deadline."""
        ids = set(preempted)
        if not ids:
            return
        deadline = time.monotonic() + self.client.config.save_timeout_s
        while True:
            self._poll_lingering()
            with self._lock:
                if not any(self._pending.get(r, 0) for r in ids):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    self._count("preemption_wait_timeouts", 1)
                    log.warning("preempted requests %s: transfers still pending after the deadline", sorted(ids))
                    return
                # Saves notify; a lingering load is only seen by polling its state.
                self._lock.wait(min(left, LINGER_POLL_S) if self._lingering else left)

    def _state(self) -> LoadState:
        st = self._free_states.pop() if self._free_states else LoadState.create()
        st.rearm()
        return st

    def _hold(self, ld: _Load) -> None:
        """Layer-wise: the load counts as a transfer of its request until it
        settles, so handle_preemptions waits for it and the request is reported
        in finished_sending (the scheduler delayed its free) only after it."""
        if self.mode != LAYERWISE:
            return  # async: the request is reported in finished_recving instead
        ld.held = True
        rid = ld.intent.request_id
        with self._lock:
            self._pending[rid] += 1
            self._saving.add(rid)

    def _unhold(self, ld: _Load) -> None:
        if not ld.held:
            return
        ld.held = False
        rid = ld.intent.request_id
        with self._lock:
            self._pending[rid] -= 1
            if self._pending[rid] <= 0:
                del self._pending[rid]
            self._lock.notify_all()

    def _recycle(self, ld: _Load) -> None:
        """The load leaves its step (idempotent). Settled (`done`): its state is
        reused (or, attached, closed) and its hold released. Timed out: it
        lingers, state mapped and blocks held, until the server settles it."""
        if ld.lingering:
            return
        if ld.timed_out and not ld.done and ld.state is not None:
            ld.lingering = True
            self._lingering.append(ld)
            return
        if ld.state is not None:
            if ld.done and ld.owned:
                self._free_states.append(ld.state)
            else:
                # The server may still write it (a Load whose answer was lost): never reuse it.
                ld.state.close()
            ld.state = None
        self._unhold(ld)

    def _poll_lingering(self) -> None:
        if not self._lingering:
            return
        now = time.monotonic()
        keep: List[_Load] = []
        for ld in self._lingering:
            ok = ld.state.poll()
            if ok is None and now < ld.at + self.load_timeout_s * LINGER_LOAD_TIMEOUTS:
                keep.append(ld)
                continue
            if ok is None:
                self._count("loads_abandoned", 1)
                log.warning(
                    "load for %s: state %s still pending %d load timeouts after it started; its blocks are "
                    "released", ld.intent.request_id, ld.state.name, LINGER_LOAD_TIMEOUTS,
                )
            ld.state.close()
            ld.state = None
            self._unhold(ld)
        self._lingering = keep

    def _fail(self, ld: _Load, why: str) -> None:
        if not ld.failed:
            ld.failed = True
            self._errors.update(ld.intent.targets)
            self._count("load_failures", 1)
            log.warning("load for %s failed (%d blocks recomputed): %s", ld.intent.request_id, len(ld.intent.targets), why)

    def start_load(self) -> None:
        """Submits one Load per load intent of the bound plan, or attaches to
        this rank's state of a Load the scheduler already sent."""
        plan = self._plan
        if plan is None or not plan.loads:
            return
        reg = self._reg()
        for intent in plan.loads:
            ld = _Load(intent, None, at=time.monotonic())
            if self.mode == ASYNC:
                self._async_loads[intent.request_id] = ld
            else:
                self._step_loads.append(ld)
            self._hold(ld)
            if intent.scatter_to is not None and not self._stage(ld):
                continue
            if intent.states is not None:
                self._attach(ld)
                continue
            if not reg.connected:
                ld.done = True
                self._fail(ld, "not connected to the server")
                continue
            ld.state = self._state()
            try:
                reg_of_load = self.staging_registration if intent.scatter_to is not None else reg
                self.client.load(
                    instance_id=reg_of_load.instance_id,
                    tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                    lease_id=intent.lease_id, block_ids=intent.block_ids, load_state_shm=ld.state.name,
                    request_id=intent.request_id,
                )
                self._count("loads", 1)
                self._count("load_blocks", len(intent.block_ids))
            except PegaflowError as e:
                # A refusal left the state alone or failed it; mark it ourselves too.
                ld.state.mark_failed()
                # Only an explicit refusal proves the server will never write this state;
                # after a timeout or a broken connection it may still: do not reuse it.
                ld.done = e.code not in MAYBE_ACCEPTED
                self._fail(ld, str(e))
                self._recycle(ld)

    def _stage(self, ld: _Load) -> bool:
        """A staged load: False (and failed: its blocks are recomputed) when this rank cannot
        scatter it — no staging blocks, or a timed-out staged load that may still write them."""
        if self.staging is None:
            ld.done = True
            self._fail(ld, "the scheduler staged this load but this worker has no staging blocks "
                           "(pegaflow.staging_blocks must be the same on both sides)")
            return False
        if any(x.intent.scatter_to is not None for x in self._lingering):
            # Its late bytes could land in the blocks this load reuses: never scatter those.
            ld.done = ld.intent.states is None  # a scheduler-issued Load may still be running
            self._fail(ld, "a timed-out staged load may still write the staging blocks")
            if not ld.done:
                self._attach(ld)
                ld.timed_out = True  # keep its state mapped until the server settles it
                self._recycle(ld)
            return False
        ld.index = self.staging.index(ld.intent.scatter_to)
        return True

    def _scatter(self, ld: _Load, upto: int) -> None:
        """Staged: layers [scattered, upto] have landed in the staging blocks; move them into
        the request's blocks (on the engine's stream, before the layer's attention)."""
        if ld.index is None or self.staging is None:
            return
        layers = self._reg().layers
        first = ld.intent.block_ids[0]
        for j in range(ld.scattered, upto + 1):
            self.staging.scatter(layers[j].name, first, ld.index)
        ld.scattered = max(ld.scattered, upto + 1)

    def _attach(self, ld: _Load) -> None:
        """A scheduler-issued load: map this rank's state (the scheduler unlinks
        its name once this step ran). No RPC here."""
        ld.owned = False
        name = ld.intent.states.get((self.tp_rank, self.pp_rank))
        if name is None:
            ld.done = True
            self._fail(ld, f"the scheduler sent no Load for tp_rank {self.tp_rank} pp_rank {self.pp_rank} "
                           f"(it loaded ranks {sorted(ld.intent.states)})")
            return
        try:
            ld.state = LoadState.attach(name)
        except (OSError, ValueError) as e:
            ld.done = True
            self._fail(ld, f"cannot attach load state {name}: {e}")
            return
        self._count("loads", 1)
        self._count("load_blocks", len(ld.intent.block_ids))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise mode: returns once `layer_name` has landed for every load of this step."""
        if not self._step_loads:
            return
        reg = self._reg()
        name = self._alias.get(layer_name, layer_name)
        try:
            idx = reg.layer_index(name)
        except KeyError:
            # A layer we never saw: wait for every layer rather than let it read early.
            idx = len(reg.layers) - 1
        for ld in self._step_loads:
            if ld.failed or ld.done or ld.state is None:
                continue
            try:
                ld.state.wait_layer(idx, self._left(ld))
                self._scatter(ld, idx)
            except PegaflowLoadError as e:
                ld.timed_out = isinstance(e, TimeoutError)
                ld.done = not ld.timed_out
                self._fail(ld, str(e))
                self._recycle(ld)

    def _left(self, ld: _Load) -> float:
        return max(0.0, ld.at + self.load_timeout_s - time.monotonic())

    def _finish_step_loads(self) -> None:
        for ld in self._step_loads:
            if not ld.done and ld.state is not None and not ld.failed:
                try:
                    ld.state.wait_all(self._left(ld))
                    self._scatter(ld, len(self._reg().layers) - 1)
                    ld.done = True
                except PegaflowLoadError as e:
                    ld.timed_out = isinstance(e, TimeoutError)
                    ld.done = not ld.timed_out
                    self._fail(ld, str(e))
            self._recycle(ld)
        self._step_loads = []

    def wait_for_save(self) -> None:
        """End of the forward: settles this step's layer-wise loads and hands
        the step's saves to the save thread (never waits for a Save)."""
        self._finish_step_loads()
        plan = self._plan
        if plan is None or not plan.saves:
            return
        event = None
        if self._cuda:
            import torch

            event = torch.cuda.Event()
            event.record()
        with self._lock:
            for s in plan.saves:
                self._pending[s.request_id] += 1
                self._saving.add(s.request_id)
        try:
            self._queue.put_nowait(_SaveJob(event, list(plan.saves)))
        except queue.Full:
            self._done_saving(plan.saves)
            self._count("saves_dropped", sum(len(s.block_ids) for s in plan.saves))
            log.warning("save queue full: dropped the saves of %d requests", len(plan.saves))

    def _done_saving(self, intents: Sequence[SaveIntent]) -> None:
        with self._lock:
            for s in intents:
                self._pending[s.request_id] -= 1
                if self._pending[s.request_id] <= 0:
                    del self._pending[s.request_id]
            self._lock.notify_all()

    def _save_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._save(job)
            finally:
                self._done_saving(job.intents)

    def _save(self, job: _SaveJob) -> None:
        blocks = sum(len(s.block_ids) for s in job.intents)
        if job.event is not None:
            job.event.synchronize()  # the step's KV writes are done before the server copies
        reg = self._reg()
        if not reg.connected:
            self._count("saves_dropped", blocks)
            return
        ids: List[int] = []
        hashes: List[bytes] = []
        for s in job.intents:
            ids.extend(s.block_ids)
            hashes.extend(s.block_hashes)
        try:
            r = self.client.save(
                instance_id=self.instance_id, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                block_ids=ids, block_hashes=hashes, request_id=job.intents[0].request_id,
            )
        except PegaflowError as e:
            self._count("saves_dropped", blocks)
            self._count("save_errors", 1)
            log.debug("save of %d blocks failed (dropped): %s", blocks, e)
            return
        self._count("saves", 1)
        self._count("blocks_saved", r.blocks_saved)
        self._count("blocks_skipped", r.blocks_skipped)
        self._count("blocks_refused", r.blocks_refused + r.blocks_not_admitted)

    def get_finished(self, finished_req_ids: Iterable[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(finished_sending, finished_recving): requests whose saves are all
        done (only those that had a save, as the scheduler delayed exactly
        those), and async loads that ended (ok or failed)."""
        recving: Set[str] = set()
        self._poll_lingering()
        if self.mode == ASYNC:
            for rid, ld in list(self._async_loads.items()):
                if not ld.done and ld.state is not None:
                    ok = ld.state.poll()
                    if ok is None:
                        if self._left(ld) > 0:
                            continue
                        self._fail(ld, f"not done after {self.load_timeout_s} s")
                        if time.monotonic() < ld.at + self.load_timeout_s * LINGER_LOAD_TIMEOUTS:
                            continue  # its copy may still land: the request keeps its blocks
                        self._count("loads_abandoned", 1)
                    else:
                        ld.done = True
                        if not ok:
                            self._fail(ld, f"load state {ld.state.name} ended with state {ld.state.state}")
                recving.add(rid)
                self._recycle(ld)
                del self._async_loads[rid]
        with self._lock:
            self._finishing |= set(finished_req_ids) & self._saving
            sending = {r for r in self._finishing if not self._pending.get(r)}
            self._finishing -= sending
            self._saving -= sending
        return (sending or None), (recving or None)

    def take_load_errors(self) -> Set[int]:
        errs, self._errors = self._errors, set()
        return errs

    def stats_snapshot(self) -> Dict[str, int]:
        with self._lock:
            out = dict(self.stats)
        if self.registration is not None:
            out.update({"registration_" + k: v for k, v in self.registration.stats().items()})
        return out

    def close(self, unregister: bool = True) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.client.config.save_timeout_s)
            self._thread = None
        if self.registration is not None:
            self.registration.close(unregister=unregister)
        if self.staging_registration is not None:
            self.staging_registration.close(unregister=unregister)
        # Unregistering drained the server's copies: every state can go now.
        for ld in self._step_loads + list(self._async_loads.values()) + self._lingering:
            if ld.state is not None:
                ld.state.close()
                ld.state = None
        self._step_loads, self._async_loads, self._lingering = [], {}, []
        for st in self._free_states:
            st.close()
        self._free_states.clear()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
