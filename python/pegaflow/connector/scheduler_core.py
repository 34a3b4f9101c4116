"""The scheduler side of a KV connector over PegaFlow (`SchedulerCore`): it decides what to load
and save; plain ids, hashes and the picklable plan of plan.py cross to the workers
(worker_core.py). Failures never raise into the engine's step: a query error is a miss.

Scheduler side (`SchedulerCore`), per request:
  probe   get_num_new_matched_tokens → QueryPrefetch of the hashes past the
          locally computed prefix, capped so at least one token is computed.
          The answer and its lease are cached per request, so repeated calls
          are side-effect free; the lease is released when the probe drifts
          (a different computed prefix), is not used, or the request ends.
          "loading" (a lower tier is fetching) answers None: ask me later. With
          `loading_wait_ms` (the default) a WaitPrefetch goes out without
          blocking the step, and the request is asked again once the server
          answers it: when the fetch ended (or after loading_wait_ms while it
          still runs). Without it (0, or a server that lacks WaitPrefetch) the
          request is asked again only after a pause that doubles from
          LOADING_RETRY_FIRST_S up to `loading_retry_s` (an engine steps every
          fraction of a millisecond while it only waits: thousands of queries a
          second would take the server's event loop from the fetch itself).
          In between, None without a query.
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
          step (their ids and the engine's own block hashes, and the requests
          whose layer-wise loads fill blocks they were computed over, in this
          step or an earlier one: the worker drops them if one of those loads failed)
  finish  request_finished → delay the free while saves or a layer-wise load
          may be pending (the worker reports the id in finished_sending when none
          is), or while an async load has not come back in finished_recving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import grpc

from ..client import MAX_PREFETCH_WAIT_MS, PegaflowClient, QueryResult
from ..errors import PegaflowError
from ..load_state import STATE_REJECTED, LoadState
from ..registration import held_by_another_engine
from .lifecycle import STATE_ANSWER_LOST, FreshStates, give_lease_back, maybe_accepted, unlink_shm
from .plan import (
    ASYNC,
    ISSUER_QUERY,
    ISSUER_SCHEDULER,
    ISSUER_WORKER,
    LAYERWISE,
    LOAD_ISSUERS,
    MODES,
    LoadIntent,
    SaveIntent,
    StepPlan,
)
from .query_issuer import EarlyLoad, QueryIssuer
from .staging import StagingRoom, staging_instance

log = logging.getLogger("pegaflow.connector")

#: A cached probe is trusted for this fraction of its lease's TTL, then asked again.
PROBE_TTL_FRACTION = 0.5
#: After a "loading" answer the same request is asked again after this pause, doubled after
#: each further "loading" up to the connector's loading_retry_s (pegaflow.loading_retry_ms).
LOADING_RETRY_FIRST_S = 0.00025
#: Default of that cap: a finished fetch is seen at most this late, and a 100 ms fetch costs
#: ~55 queries instead of one per engine step.
LOADING_RETRY_MAX_S = 0.002
#: Default WaitPrefetch hold after a "loading" answer (pegaflow.loading_wait_ms): the server
#: answers when the fetch ends, so this only bounds how long one wait lasts; a longer fetch
#: is asked about again and waited for again.
LOADING_WAIT_MS = 1000


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
class _Waiting:
    """A request whose last answer was "loading": not asked again before `until` (set to 0 by
    its WaitPrefetch's answer, on the client's reader thread: ask at the next call)."""

    until: float
    pause: float
    probe: Tuple[int, int]  # (computed, asked) it was asked with


@dataclass
class _Tracked:
    request: Any
    block_ids: List[int] = field(default_factory=list)
    saved_upto: int = 0
    had_save: bool = False
    had_load: bool = False  # layer-wise: the workers hold the blocks until the load settled
    # Layer-wise: the requests whose loads fill blocks this request's KV is computed over (its own
    # load, and loads of blocks it starts with as a prefix hit; not the fresh blocks it computes
    # itself): its saves name them (SaveIntent.after_loads) for as long as it runs, as a step the
    # engine scheduled before it saw such a load fail still computes over it (vLLM's async
    # scheduling).
    after: Tuple[str, ...] = ()
    load_targets: List[int] = field(default_factory=list)  # layer-wise: its load's blocks


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
        loading_retry_s: float = LOADING_RETRY_MAX_S,
        loading_wait_ms: int = LOADING_WAIT_MS,
        clock: Any = time.monotonic,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if load_issuer not in LOAD_ISSUERS:
            raise ValueError(f"load_issuer {load_issuer!r} is not one of {LOAD_ISSUERS}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must name each (tp_rank, pp_rank) of the instance once, got {list(ranks)}")
        if not loading_retry_s >= 0:
            raise ValueError(f"loading_retry_s must be >= 0, got {loading_retry_s}")
        if not isinstance(loading_wait_ms, int) or not 0 <= loading_wait_ms <= MAX_PREFETCH_WAIT_MS:
            raise ValueError(f"loading_wait_ms must be 0..{MAX_PREFETCH_WAIT_MS}, got {loading_wait_ms!r}")
        # The client's `engine_id` (vLLM's kv_transfer_config.engine_id, as the workers
        # register) goes with every query and Load, which the server refuses when the instance
        # is another engine's (this engine misconfigured with its instance id). "" = not checked.
        self.client = client
        self._other_engine_logged = False
        self.loading_retry_s = loading_retry_s
        # 0 once the server answered a WaitPrefetch UNIMPLEMENTED (it predates the call).
        self.loading_wait_ms = loading_wait_ms
        self._clock = clock
        self._waiting: Dict[str, _Waiting] = {}
        self._granularity_warned = False
        # Requests whose block hashes are not one per block (_hashes_per_block), until they finish.
        self._refused: Set[str] = set()
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
        # Async mode: requests whose load has not come back in finished_recving yet, and the
        # blocks each loads into (a failed one's blocks come back in invalid_block_ids).
        self._loading: Set[str] = set()
        self._async_targets: Dict[str, Set[int]] = {}
        # Async mode: requests whose load failed. vLLM retries such a request, asking
        # get_num_new_matched_tokens again: it is a miss from then on, or a load that fails every
        # time (a refused rank, a server too slow for the load timeout) is retried at every step.
        self._load_failed: Set[str] = set()
        # Layer-wise: block → the request whose load fills it (_Tracked.after), while the block is
        # that request's: until it is preempted, re-admitted, or its blocks are freed after it
        # finished (finished_sending). A finished request's free is delayed (its load), and vLLM
        # may admit another request on those blocks meanwhile (a prefix hit), in a step scheduled
        # before it saw the load fail: _finished_loads keeps the finished requests' targets.
        self._lw_blocks: Dict[int, str] = {}
        self._finished_loads: Dict[str, List[int]] = {}
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

    def _hashes_per_block(self, request: Any) -> bool:
        """Whether `request.block_hashes` holds exactly one hash per full block of
        `block_size` tokens, as the store's keys need (a block is saved and found under the
        hash that ends on its last token). vLLM hashes at another granularity with hybrid
        KV cache groups, context parallelism, or a `hash_block_size` (`prefix_match_unit`)
        below the block size, and not at all with prefix caching off: stored under such
        hashes, a block would be served for a prefix that shares only its first tokens.
        Such a request is never loaded or saved (a miss), said once per process; a request
        that passes is tracked from here on."""
        rid = request.request_id
        if rid in self._tracked:
            return True
        hashes = request.block_hashes
        want = request.num_tokens // self.block_size
        if len(hashes) == want:
            self._tracked[rid] = _Tracked(request)
            return True
        if rid in self._refused:
            return False
        self._refused.add(rid)
        self.stats["hash_granularity_refused"] += 1
        if not self._granularity_warned:
            self._granularity_warned = True
            why = (
                "none (is vLLM's prefix caching off?)" if not hashes
                else f"{len(hashes)} (hashed every ~{request.num_tokens // len(hashes)} tokens)"
            )
            log.error(
                "request %s: %d tokens in blocks of %d need %d block hashes, the engine gave %s: "
                "PegaFlow neither loads nor saves such requests (one hash per KV block is required)",
                rid, request.num_tokens, self.block_size, want, why,
            )
        return False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        rid = request.request_id
        if not self._hashes_per_block(request):
            return 0, False
        if rid in self._load_failed:
            self.stats["failed_load_retries"] += 1
            return 0, False
        bs = self.block_size
        hashes = request.block_hashes
        computed = num_computed_tokens // bs
        # At least the last token is computed by the engine (it needs its logits).
        loadable = min(len(hashes), max(0, (request.num_tokens - 1) // bs))
        asked = loadable - computed
        if asked <= 0:
            self._release(self._probes.pop(rid, None))
            self._waiting.pop(rid, None)
            return 0, False
        now = self._clock()
        w = self._waiting.get(rid)
        if w is not None and now < w.until and w.probe == (computed, asked):
            self.stats["query_loading_deferred"] += 1
            return None, False
        p = self._probes.get(rid)
        if p is not None and (p.computed_blocks, p.asked) == (computed, asked) and (
            p.early is not None or now - p.at < p.result.ttl_ms / 1000.0 * PROBE_TTL_FRACTION
        ):
            return self._answer(p)
        self._release(self._probes.pop(rid, None))
        if self.staging is not None:
            if self._query_issuer is not None:
                self._query_issuer.poll()  # runs whose copies settled since the last step are free
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
                    instance_id=self.load_instance, block_hashes=hashes[computed:loadable], request_id=rid,
                )
        except PegaflowError as e:
            # Server away, instance not (yet) registered, another engine's: a miss, never an
            # error in the step.
            self._query_failed(rid, e)
            self._waiting.pop(rid, None)
            return 0, False
        if q.loading:
            self.stats["query_loading"] += 1
            if self.loading_wait_ms > 0:
                self._wait_for_fetch(rid, _Waiting(now + self.loading_wait_ms / 1000.0, 0.0, (computed, asked)))
            elif self.loading_retry_s > 0:
                # (A wait's entry has no pause: polling after it starts from the first.)
                pause = min(self.loading_retry_s, 2 * w.pause if w and w.pause > 0 else LOADING_RETRY_FIRST_S)
                self._waiting[rid] = _Waiting(now + pause, pause, (computed, asked))
            return None, False
        self._waiting.pop(rid, None)
        p = _Probe(computed, asked, q, now, rid, early)
        self._probes[rid] = p
        if self.staging is not None and early is None:
            self.staging.reserve(q.hits)
        self.stats["hit_blocks"] += q.hits
        return self._answer(p)

    def _wait_for_fetch(self, rid: str, w: _Waiting) -> None:
        """Files `w` and sends its WaitPrefetch without waiting: its answer (the fetch ended,
        the hold passed, or an error) lets the request be asked at the next call. A server
        without WaitPrefetch turns waiting off for good: polling with pauses from then on."""
        self._waiting[rid] = w

        def answered(_settled: Optional[bool], err: Optional[PegaflowError]) -> None:
            if err is not None:
                self.stats["wait_errors"] += 1
                if err.code == grpc.StatusCode.UNIMPLEMENTED and self.loading_wait_ms > 0:
                    self.loading_wait_ms = 0
                    log.warning(
                        "the PegaFlow server at %s has no WaitPrefetch (an older server): requests "
                        "waiting for a lower tier are polled every <= %.1f ms instead",
                        self.client.address, self.loading_retry_s * 1e3,
                    )
            w.until = 0.0

        self.stats["waits"] += 1
        try:
            self.client.wait_prefetch_nowait(
                instance_id=self.load_instance, request_id=rid, wait_ms=self.loading_wait_ms, on_done=answered,
            )
        except PegaflowError as e:  # not sent: ask again after the shortest pause
            self.stats["wait_errors"] += 1
            log.debug("WaitPrefetch for %s not sent (asking again): %s", rid, e)
            w.until = self._clock() + LOADING_RETRY_FIRST_S

    def _query_failed(self, rid: str, e: PegaflowError) -> None:
        """Counts a failed query (answered 0 hits). One refused because the instance belongs to
        another engine (the server checks the engine id) is a misconfiguration, not a passing
        state: said once as an error, counted apart; the others at debug level, as before."""
        self.stats["query_errors"] += 1
        if not held_by_another_engine(e):
            log.debug("query for %s failed (answering 0 hits): %s", rid, e)
            return
        self.stats["query_other_engine"] += 1
        if self._other_engine_logged:
            log.debug("query for %s refused (answering 0 hits): %s", rid, e)
            return
        self._other_engine_logged = True
        log.error(
            "instance %s (engine_id %r) is registered by another engine: this engine's queries are "
            "refused and its requests computed without PegaFlow until the instance is gone; give "
            "this engine its own pegaflow.instance_id (%s)", self.load_instance, self.client.engine_id, e,
        )

    def _answer(self, p: _Probe) -> Tuple[int, bool]:
        hits = p.result.hits
        return hits * self.block_size, hits > 0 and self.mode == ASYNC

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """`block_ids`: all of the request's blocks (group 0), local prefix first."""
        rid = request.request_id
        p = self._probes.pop(rid, None)
        if not self._hashes_per_block(request):
            return  # never probed (no lease to give back): not ours to load or save
        tr = self._tracked[rid]
        if tr.load_targets:
            # Admitted again (preempted where no preempted_req_ids said so: vLLM's
            # reset_prefix_cache): its earlier load's blocks were freed, no longer its.
            self._forget_load(rid, tr.load_targets)
            tr.load_targets = []
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
            self._async_targets[rid] = set(targets)
        else:
            tr.had_load = True
            tr.load_targets = targets
            for b in targets:
                self._lw_blocks[b] = rid
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
                    lost = maybe_accepted(err)
                    st.mark_failed(STATE_ANSWER_LOST if lost else STATE_REJECTED)
                    self._count("load_issue_errors")
                    log.warning(
                        "request %s: Load of tp_rank %d pp_rank %d failed (recomputed): %s",
                        intent.request_id, rank[0], rank[1], err,
                    )
                    if not lost:
                        self._give_back(intent)  # a refused Load leaves its lease as it was
                st.close()
                self._passed(st.name, 0)

            try:
                self.client.load_nowait(
                    instance_id=self.load_instance, tp_rank=tp_rank, pp_rank=pp_rank, lease_id=intent.lease_id,
                    block_ids=intent.block_ids, load_state_shm=st.name, request_id=intent.request_id,
                    on_done=answered, whole=self.mode == ASYNC,
                )
                self._count("loads_issued")
            except PegaflowError as e:  # the client is closed: nothing was sent
                answered(e)

    def _give_back(self, intent: LoadIntent) -> None:
        """A rank's Load was refused: its lease goes back now (lifecycle.give_lease_back)."""
        if give_lease_back(self.client, intent.lease_id, intent.request_id):
            self._count("leases_given_back")

    # -- step --

    def build_step(
        self,
        scheduled: Iterable[Tuple[str, Optional[Sequence[int]], bool, int, int]],
        preempted: Iterable[str] = (),
    ) -> StepPlan:
        """The step's plan: its loads (issued since the last step), the saves of blocks that
        complete in it, the preempted requests. `scheduled`: ScheduledRequest or plain tuples
        of its fields, one per request the step runs."""
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
                self._forget_load(rid, tr.load_targets)
                tr.load_targets = []
        bs = self.block_size
        tracked = self._tracked
        # Layer-wise loads by target block (_lw_blocks): a block computed over one of them is wrong
        # if that load failed, so its save names the load (SaveIntent.after_loads).
        loading = self._lw_blocks
        # Once per running request per step: plain tuple unpacking, no attribute lookups.
        for rid, new_ids, replace, computed, nsched in scheduled:
            tr = tracked.get(rid)
            if tr is None:
                continue  # never probed: not ours to save
            if new_ids is None:
                pass
            elif replace:
                tr.block_ids = list(new_ids)
                # New or resumed: its KV is computed over the loads of the blocks it starts with as
                # computed (its own load, prefix hits), whichever step it runs in (after_loads).
                # Its fresh blocks hold what it computes itself, whatever load once filled them.
                tr.after = (
                    tuple({loading[b] for b in tr.block_ids[:computed // bs] if b in loading}) if loading else ()
                )
            elif new_ids:
                tr.block_ids.extend(new_ids)  # own list (intents copy their slices)
            done = (computed + nsched) // bs
            if done <= tr.saved_upto:
                continue  # no block completes in this step (most decode steps): nothing to save
            hashes = tr.request.block_hashes
            publishable = getattr(tr.request, "num_publishable_block_hashes", None)
            n_hash = len(hashes) if publishable is None else min(len(hashes), publishable)
            full = min(done, n_hash, len(tr.block_ids))
            if full > tr.saved_upto:
                plan.saves.append(
                    SaveIntent(rid, tr.block_ids[tr.saved_upto:full], list(hashes[tr.saved_upto:full]), tr.after)
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
        self._waiting.pop(rid, None)
        tr = self._tracked.pop(rid, None)
        self._refused.discard(rid)
        self._load_failed.discard(rid)
        if tr is not None and tr.load_targets:
            # Its blocks stay its load's until they are freed (finished_sending): see _lw_blocks.
            self._finished_loads[rid] = tr.load_targets
        if rid in self._loading or (tr is not None and (tr.had_save or tr.had_load)):
            self._delayed.add(rid)
            return True
        return False

    def finished_sending(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._delayed.discard(rid)
            if self._finished_loads:
                targets = self._finished_loads.pop(rid, None)
                if targets:
                    self._forget_load(rid, targets)

    def finished_recving(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._async_targets.pop(rid, None)
            if rid in self._loading:
                self._loading.discard(rid)
                self._delayed.discard(rid)

    def load_errors(self, block_ids: Iterable[int]) -> None:
        """The blocks the workers reported as failed to load (vLLM's invalid_block_ids), before
        that output's finished_recving: an async load into one of them failed, and its request,
        which vLLM retries, is offered no load again (get_num_new_matched_tokens answers 0)."""
        bad = set(block_ids)
        if not bad or not self._async_targets:
            return
        for rid, targets in self._async_targets.items():
            if not targets.isdisjoint(bad) and rid in self._tracked:
                self._load_failed.add(rid)

    def _forget_load(self, rid: str, targets: Iterable[int]) -> None:
        """`rid`'s blocks are freed (preempted, admitted again, or finished and handed back): its
        layer-wise load's blocks `targets` are no longer its (another request may get them)."""
        for b in targets:
            if self._lw_blocks.get(b) == rid:
                del self._lw_blocks[b]

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

