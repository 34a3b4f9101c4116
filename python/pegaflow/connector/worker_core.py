"""The worker side of a KV connector over PegaFlow (`WorkerCore`, one per rank): it moves the
bytes the scheduler side (scheduler_core.py) planned (plan.py).

Worker side (`WorkerCore`): registration (KvRegistration: survives server
restarts), Loads with a LoadState each (or attached to the scheduler's),
per-layer waits (layer-wise mode) or polling between steps (async mode), and
a save thread so a step never waits for a Save (and sends a step's Save while a later step's
GPU work runs: the save gate, `SAVE_GATE_S`). A load that timed out may
still land: it keeps its request's blocks held (handle_preemptions waits for
it, finished_sending waits for it) until the server settles its state. Failures never raise into the engine: a query error is a miss,
a save error is a dropped save (counted), a load error lists the blocks in
`take_load_errors()` so the engine recomputes them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..client import PegaflowClient
from ..errors import PegaflowError, PegaflowLoadError
from ..gpu_wait import GpuWaits
from ..load_state import STATE_PENDING, LoadState
from ..regions import export_kv_layers
from ..registration import KvRegistration
from .lifecycle import LINGER_LOAD_TIMEOUTS, STATE_ANSWER_LOST, give_lease_back, maybe_accepted
from .plan import ASYNC, LAYERWISE, MODES, LoadIntent, SaveIntent, StepPlan
from .staging import StagingBuffers, staging_instance

log = logging.getLogger("pegaflow.connector")

#: How often a wait that only lingering loads can end polls their states.
LINGER_POLL_S = 0.001

#: The save gate's longest wait (pegaflow.save_gate_ms). A step's Save leaves the save thread once
#: a later step's forward has been launched (that step's get_finished), not when the step's KV is
#: written: the save thread's Python (the request, its reply) then runs while the engine's thread
#: waits for the GPU, instead of taking the GIL from it between steps, where every microsecond is
#: one the GPU idles (decode on H200 hosts: 0.88-1.99 % slower than PegaFlow off without the gate,
#: 0.50-1.23 % with it; docs/python.md, "The save gate"). An engine that stops stepping (idle, or a
#: step longer than this) has its saves sent after this at the latest.
SAVE_GATE_S = 0.1


# ---- worker side --------------------------------------------------------------


def _tensor_key(t: Any) -> Tuple[int, Tuple[int, ...], Tuple[int, ...]]:
    """(data pointer, shape, strides): equal for two names of one KV tensor."""
    if hasattr(t, "data_ptr"):
        return t.data_ptr(), tuple(t.shape), tuple(t.stride())
    return t.__array_interface__["data"][0], tuple(t.shape), tuple(t.strides)


def _unsettled(st: LoadState) -> bool:
    """The server may still write into what this load targets: pending, or its Load's answer was
    lost (lifecycle.STATE_ANSWER_LOST) and no Load reached the server since to end it."""
    return _unsettled_word(st.state)


def _unsettled_word(s: int) -> bool:
    """`_unsettled` of a state word already read (one read: see get_finished)."""
    return s == STATE_PENDING or s == STATE_ANSWER_LOST


def _maybe_landing(e: PegaflowLoadError) -> bool:
    """A wait that failed this way leaves a copy that may still land (held until settled)."""
    return isinstance(e, TimeoutError) or e.state == STATE_ANSWER_LOST


def _session_ended(reg: KvRegistration, lost: int) -> Optional[str]:
    """Why the session of `reg`'s rank ended since `sessions_lost` read `lost`, or None while it
    stands (WorkerCore._server_gone)."""
    if reg.connected and reg.sessions_lost == lost:
        return None
    why = reg.last_error or "disconnected"
    return f"{reg.who}: its session with the server ended after the Load was sent ({why})"


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
    gpu: bool = False  # its layer waits are enqueued on the GPU stream (gpu_wait.py)
    # The registration of the instance the Load targets, and its counters when the load began
    # (_server_gone: sessions_lost; _server_forgot: registrations_begun), and the layer waits'
    # give_up (_session_ended of those, bound once per load).
    reg: Optional[KvRegistration] = None
    lost: int = 0
    begun: int = 0
    give_up: Optional[Callable[[], Optional[str]]] = None


@dataclass
class _SaveJob:
    event: Any
    intents: List[SaveIntent]
    #: Order of enqueueing: a preemption that gave up waiting cuts the jobs queued before it.
    seq: int = 0
    #: Hashes of saves dropped as computed over this rank's failed loads, sent as the Save's
    #: discard_hashes (the other ranks may have saved their KV of them: wait_for_save).
    discard: List[bytes] = field(default_factory=list)
    #: The request those saves were of (the Save's request_id when it carries no intent).
    discard_request: str = ""
    #: The steps the worker had ended (get_finished calls) when the job was queued: the save gate
    #: opens when two more have (this step's, then the next one's, after its forward launched).
    ends: int = 0


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
        gpu_waits: bool = True,
        save_gate_s: float = SAVE_GATE_S,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if staging_blocks < 0:
            raise ValueError(f"staging_blocks must be >= 0, got {staging_blocks}")
        if not save_gate_s >= 0:
            raise ValueError(f"save_gate_s must be >= 0, got {save_gate_s}")
        # The client's `engine_id` (vLLM's kv_transfer_config.engine_id, the same on every rank)
        # goes with this rank's registration, Loads and Saves: the server refuses a rank, Load or
        # Save of another engine under this instance id ("" = not checked).
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
        # Layer-wise loads on CUDA wait on the GPU stream, not the host (gpu_wait.py).
        self._gpu_waits_wanted = gpu_waits and mode == LAYERWISE
        self._gpu: Optional[GpuWaits] = None
        self._plan: Optional[StepPlan] = None
        #: Layer-wise: this step's loads, which wait_for_layer_load gates on (empty in async
        #: mode and in every step without a load: the connector then returns at once).
        self.step_loads: List[_Load] = []
        self._async_loads: Dict[str, _Load] = {}
        self._free_states: List[LoadState] = []
        self._errors: Set[int] = set()
        # Layer-wise: requests whose load failed on this rank, until they finish. A save naming
        # one (SaveIntent.after_loads) is dropped, in the step of the load and in any later one:
        # the engine may have scheduled steps that compute over it before it saw the failure.
        self._failed_loads: Set[str] = set()
        # With TP or PP the other ranks computed their KV of those blocks from this rank's
        # garbage (all-reduce, stage hand-off): the dropped saves' hashes go to the server as
        # discard_hashes, in order with this rank's saves. Kept here when the queue was full,
        # for the next job.
        self._discards_other_ranks = tp_size * pp_size > 1
        self._unsent_discard: Tuple[List[bytes], str] = ([], "")
        self._lock = threading.Condition()
        # request → its saves queued or in flight and its layer-wise loads not settled
        self._pending: Dict[str, int] = defaultdict(int)
        # requests with a save or a layer-wise load on this worker (reported in finished_sending)
        self._saving: Set[str] = set()
        self._lingering: List[_Load] = []  # timed-out loads whose copy may still land
        self._finishing: Set[str] = set()
        self._queue: "queue.Queue[Optional[_SaveJob]]" = queue.Queue(maxsize=save_queue_depth)
        self._save_seq = 0
        # The save gate (_await_gate; 0 = off): the steps ended so far (get_finished), the count
        # the save thread waits for (-1: none), and the jobs let through at once (seq <= this:
        # a preemption or close() waiting for them).
        self.save_gate_s = save_gate_s
        self._ends = 0
        self._gate_at = -1
        self._flush_seq = 0
        # request → the last job queued before a preemption that stopped waiting for its saves:
        # its blocks are being reused, so those jobs' intents of it must never be sent
        self._cut: Dict[str, int] = {}
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
        if self._cuda and self._gpu_waits_wanted:
            self._gpu = GpuWaits.open()
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
        if self._gpu is not None:
            self._gpu.close_kept()  # the step has launched nothing yet: the stream may be idle

    def unbind(self) -> None:
        self._plan = None

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        """Returns once no save of these requests is queued or in flight and
        no load into their blocks may still land (the blocks are about to be
        reused), or after the save deadline."""
        ids = set(preempted)
        if not ids:
            return
        self._flush_saves()  # their blocks are reused next: no gate holds their saves
        deadline = time.monotonic() + self.client.config.save_timeout_s
        while True:
            self._poll_lingering()
            with self._lock:
                if not any(self._pending.get(r, 0) for r in ids):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    self._count("preemption_wait_timeouts", 1)
                    # vLLM reuses their blocks next: a save still queued would read another
                    # request's KV and store it under these requests' hashes. Cut those saves
                    # (a Save already sent is past recall: it holds up to its RPC deadline).
                    for r in ids:
                        if self._pending.get(r, 0):
                            self._cut[r] = self._save_seq
                    log.warning(
                        "preempted requests %s: transfers still pending after the deadline; their queued saves "
                        "are dropped", sorted(ids),
                    )
                    return
                # Saves notify; a lingering load is only seen by polling its state.
                self._lock.wait(min(left, LINGER_POLL_S) if self._lingering else left)

    def _state(self) -> LoadState:
        if self._gpu is not None:
            self._gpu.reap()
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

    @staticmethod
    def _server_gone(ld: _Load) -> Optional[str]:
        """Why no server will write a pending load's state any more, or None: the session of the
        rank the Load targets ended since it was sent (the server died, or it is cleaning the
        instance up, which settles the state). Its wait ends then (a server gone mid-load once
        held a layer-wise forward until the load timeout, 60 s by default); what it may still
        write stays held, as after a deadline, until the state settles or `_server_forgot`."""
        return None if ld.reg is None else _session_ended(ld.reg, ld.lost)

    @staticmethod
    def _server_forgot(ld: _Load) -> bool:
        """A RegisterContext begun after the load began registered the rank anew: the server that
        took its Load no longer holds that registration (it died, or it cleaned the instance up
        after draining its copies), so nothing will write what the load targets any more. A load
        lost with its server once kept its request's blocks (and a preemption's wait) for 3 load
        timeouts. A registration begun earlier and answered since does not count: it may be the
        one that took the Load (KvRegistration.registered_anew_since)."""
        return ld.reg is not None and ld.reg.registered_anew_since(ld.begun)

    def _unhold(self, ld: _Load) -> None:
        if not ld.held:
            return
        ld.held = False
        rid = ld.intent.request_id
        with self._lock:
            self._pending[rid] -= 1
            if self._pending[rid] <= 0:
                del self._pending[rid]
                self._cut.pop(rid, None)  # no job of it left to cut (as in _done_saving)
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
            # Not done: the server may still write it (a Load whose answer was lost): never reuse it.
            self._let_go(ld.state, reuse=ld.done and ld.owned)
            ld.state = None
        self._unhold(ld)

    def _let_go(self, st: LoadState, reuse: bool) -> None:
        """Back to the free list (`reuse`) or closed; a state the GPU waits on, only once the
        stream has passed those waits (gpu_wait.py)."""
        if st.gpu_word is not None and self._gpu is not None:
            # Closed only with the stream idle (its unregister waits for the device to drain).
            self._gpu.retire(st, self._free_states.append if reuse else self._gpu.close_later)
        elif reuse:
            self._free_states.append(st)
        else:
            st.close()

    def _arm_gpu(self, ld: _Load) -> None:
        """Layer-wise on CUDA: this load's layer waits go on the GPU stream when its state can
        be mapped for the GPU."""
        ld.gpu = self._gpu is not None and ld.state is not None and self._gpu.arm(ld.state)
        if ld.gpu:
            self._gpu.guard(ld.state, ld.at + self.load_timeout_s)
            self._count("gpu_wait_loads", 1)

    def _poll_lingering(self) -> None:
        if not self._lingering:
            return
        now = time.monotonic()
        keep: List[_Load] = []
        for ld in self._lingering:
            unsettled = _unsettled(ld.state)
            forgot = unsettled and self._server_forgot(ld)
            if unsettled and not forgot and now < ld.at + self.load_timeout_s * LINGER_LOAD_TIMEOUTS:
                keep.append(ld)
                continue
            if unsettled:
                self._abandoned(ld, forgot)
            self._let_go(ld.state, reuse=False)
            ld.state = None
            self._unhold(ld)
        self._lingering = keep

    def _abandoned(self, ld: _Load, forgot: bool) -> None:
        """Counts and logs a load whose state never settled, let go."""
        self._count("loads_abandoned", 1)
        if forgot:
            log.warning(
                "load for %s: state %s never settled; %s was registered anew since (the server that took the "
                "Load is gone): its blocks are released", ld.intent.request_id, ld.state.name, ld.reg.who,
            )
        else:
            log.warning(
                "load for %s: state %s still pending %d load timeouts after it started; its blocks are "
                "released", ld.intent.request_id, ld.state.name, LINGER_LOAD_TIMEOUTS,
            )

    def _fail(self, ld: _Load, why: str) -> None:
        if not ld.failed:
            ld.failed = True
            self._errors.update(ld.intent.targets)
            if self.mode == LAYERWISE:
                self._failed_loads.add(ld.intent.request_id)
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
            reg_of_load = self.staging_registration if intent.scatter_to is not None else reg
            ld = _Load(intent, None, at=time.monotonic())
            if reg_of_load is not None:
                ld.reg, ld.lost, ld.begun = reg_of_load, reg_of_load.sessions_lost, reg_of_load.registrations_begun
                # Bound once per load (a lambda per layer wait cost an allocation per layer per
                # load per step), and not over `ld` (a cycle per load for the collector).
                ld.give_up = partial(_session_ended, reg_of_load, ld.lost)
            if self.mode == ASYNC:
                self._async_loads[intent.request_id] = ld
            else:
                self.step_loads.append(ld)
            self._hold(ld)
            if intent.scatter_to is not None and not self._stage(ld):
                continue
            if intent.states is not None:
                if reg_of_load is not None and not reg_of_load.connected:
                    self._not_registered(ld, reg_of_load)
                self._attach(ld)
                continue
            if not reg.connected:
                ld.done = True
                self._fail(ld, "not connected to the server")
                # No Load will use the lease: back now (no wait), not at its TTL. A server that is
                # up (this rank refused as held by another engine) kept it at every such query.
                self._give_back(ld)
                continue
            ld.state = self._state()
            self._arm_gpu(ld)
            try:
                self.client.load(
                    instance_id=reg_of_load.instance_id,
                    tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                    lease_id=intent.lease_id, block_ids=intent.block_ids, load_state_shm=ld.state.name,
                    request_id=intent.request_id, whole=self.mode == ASYNC,
                )
                self._count("loads", 1)
                self._count("load_blocks", len(intent.block_ids))
            except PegaflowError as e:
                self._fail(ld, str(e))
                if maybe_accepted(e):
                    # It may have reached the server, whose copy may still land: failed for the
                    # engine, but its state stays mapped and what it may write held until the
                    # server settles it (layer-wise: lingering; async: get_finished waits).
                    ld.state.mark_failed(STATE_ANSWER_LOST)
                    if self.mode == LAYERWISE:
                        ld.timed_out = True
                        self._recycle(ld)
                    continue
                # A refusal left the state alone or failed it; mark it ourselves too.
                ld.state.mark_failed()
                ld.done = True
                self._give_back(ld)  # a refused Load leaves its lease as it was
                self._recycle(ld)

    def _not_registered(self, ld: _Load, reg: KvRegistration) -> None:
        """A Load the scheduler (or a query) already sent for this rank while the rank is not
        registered: the server copied it into whatever holds the instance id now (another
        engine's memory, when this rank is refused as held by another engine: the scheduler
        side registers nothing and cannot tell), never into this rank's blocks. Failed
        (recomputed); its state stays mapped until the server settles it, as a copy begun
        before this rank's session broke may still land in its blocks."""
        self._fail(ld, f"this rank is not registered ({reg.last_error or 'not connected'}): the scheduler's "
                       f"Load did not land in its memory")
        if self.mode == LAYERWISE:
            ld.timed_out = True  # lingers (blocks held) until the server settles it

    def _stage(self, ld: _Load) -> bool:
        """A staged load: False (and failed: its blocks are recomputed) when this rank cannot
        scatter it — no staging blocks, or a timed-out staged load that may still write them."""
        if self.staging is None:
            ld.done = True
            self._fail(ld, "the scheduler staged this load but this worker has no staging blocks "
                           "(pegaflow.staging_blocks must be the same on both sides)")
            self._give_back(ld)
            return False
        if any(x.intent.scatter_to is not None for x in self._lingering):
            # Its late bytes could land in the blocks this load reuses: never scatter those.
            ld.done = ld.intent.states is None  # a scheduler-issued Load may still be running
            self._fail(ld, "a timed-out staged load may still write the staging blocks")
            self._give_back(ld)
            if not ld.done:
                self._attach(ld)
                ld.timed_out = True  # keep its state mapped until the server settles it
                self._recycle(ld)
            return False
        ld.index = self.staging.index(ld.intent.scatter_to)
        return True

    def _give_back(self, ld: _Load) -> None:
        """This rank will not load from the lease (lifecycle.give_lease_back). Not when the
        server already started this rank's load (scheduler- or query-issued: `states`)."""
        if ld.intent.states is None and give_lease_back(self.client, ld.intent.lease_id, ld.intent.request_id):
            self._count("leases_given_back", 1)

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
        self._arm_gpu(ld)
        self._count("loads", 1)
        self._count("load_blocks", len(ld.intent.block_ids))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise mode: returns once `layer_name` has landed for every load of this step."""
        if not self.step_loads:
            return
        reg = self._reg()
        name = self._alias.get(layer_name, layer_name)
        try:
            idx = reg.layer_index(name)
        except KeyError:
            # A layer we never saw: wait for every layer rather than let it read early.
            idx = len(reg.layers) - 1
        for ld in self.step_loads:
            if ld.failed or ld.done or ld.state is None:
                continue
            if ld.gpu and ld.state.poll() is None:
                # The stream waits; the host goes on launching. The deadline is kept at the
                # step's end (_finish_step_loads).
                if self._gpu.wait(ld.state, idx):
                    self._scatter(ld, idx)
                    continue
                ld.gpu = False
            try:
                ld.state.wait_layer(idx, self._left(ld), ld.give_up)
                self._scatter(ld, idx)
            except PegaflowLoadError as e:
                ld.timed_out = _maybe_landing(e)
                ld.done = not ld.timed_out
                self._fail(ld, str(e))
                self._let_stream_go(ld)
                self._recycle(ld)

    def _left(self, ld: _Load) -> float:
        return max(0.0, ld.at + self.load_timeout_s - time.monotonic())

    def _let_stream_go(self, ld: _Load) -> None:
        """A load that failed or ran out of time: every wait the stream holds on its state passes
        now. A failure need not raise `layers_ready` past the waits (a state failed on this
        side, by the scheduler when its Load broke, never does; the server writes all ones for a
        rank it does not know, which the stream's cyclic compare reads as -1), and once the
        state is recycled the watchdog no longer guards it: the step would hang for good."""
        if self._gpu is not None and ld.state is not None and ld.state.gpu_word is not None:
            self._gpu.release(ld.state)

    def _finish_step_loads(self) -> None:
        for ld in self.step_loads:
            if not ld.done and ld.state is not None and not ld.failed:
                try:
                    ld.state.wait_all(self._left(ld), ld.give_up)
                    ld.done = True
                    if ld.state.released:
                        # Let go at its deadline (the watchdog) before it reported done: the
                        # stream (or a host wait, which a released word passes too) may have
                        # read a layer before it landed.
                        self._fail(ld, f"load state {ld.state.name}: done after its deadline released the GPU's waits")
                    else:
                        self._scatter(ld, len(self._reg().layers) - 1)
                except PegaflowLoadError as e:
                    ld.timed_out = _maybe_landing(e)
                    ld.done = not ld.timed_out
                    self._fail(ld, str(e))
                    self._let_stream_go(ld)  # no stream waits on past the deadline
            self._recycle(ld)
        self.step_loads = []
        if self._gpu is not None:
            self._gpu.reap()

    def wait_for_save(self) -> None:
        """End of the forward: settles this step's layer-wise loads and hands
        the step's saves to the save thread (never waits for a Save). A save of
        blocks computed over a layer-wise load that failed (this step's, or an
        earlier step's: the engine may have scheduled this step before it saw the
        failure) is dropped: their KV is wrong (vLLM recomputes them), and stored
        under the prompt's hashes it would be served to every later request with
        that prefix. With TP or PP the other ranks computed theirs from this
        rank's garbage and save them: their hashes go with this rank's next Save
        as `discard_hashes` (the server drops those blocks and refuses them for a
        while), queued in order with its saves."""
        self._finish_step_loads()
        plan = self._plan
        saves = plan.saves if plan is not None else []
        discard, discard_request = self._unsent_discard
        if self._failed_loads and saves:
            saves, dropped = self._drop_failed(saves)
            if dropped and self._discards_other_ranks:
                discard = discard + [h for s in dropped for h in s.block_hashes]
                discard_request = discard_request or dropped[0].request_id
        if not saves and not discard:
            return
        self._unsent_discard = ([], "")
        event = None
        if saves and self._cuda:
            import torch

            # Blocking: the save thread sleeps in the driver until the step's writes are done,
            # instead of spinning a core beside the engine's launches for a whole step.
            event = torch.cuda.Event(blocking=True)
            event.record()
        with self._lock:
            for s in saves:
                self._pending[s.request_id] += 1
                self._saving.add(s.request_id)
            self._save_seq += 1
            seq = self._save_seq
        try:
            self._queue.put_nowait(_SaveJob(event, list(saves), seq, discard, discard_request, self._ends))
        except queue.Full:
            self._done_saving(saves)
            self._count("saves_dropped", sum(len(s.block_ids) for s in saves))
            # Never lost: the next job carries it, ahead of its own saves.
            self._unsent_discard = (discard, discard_request)
            log.warning(
                "save queue full: dropped the saves of %d requests%s", len(saves),
                f"; the discard of {len(discard)} blocks goes with the next job" if discard else "",
            )

    def _drop_failed(self, intents: Sequence[SaveIntent]) -> Tuple[List[SaveIntent], List[SaveIntent]]:
        """(kept, dropped): the saves computed over a failed load of this rank are dropped."""
        failed = self._failed_loads
        saves = [s for s in intents if failed.isdisjoint(s.after_loads)]
        dropped = [s for s in intents if not failed.isdisjoint(s.after_loads)]
        if dropped:
            self._count("saves_dropped", sum(len(s.block_ids) for s in dropped))
            log.warning(
                "tp_rank %d: saves of requests %s dropped: computed over the failed loads of %s",
                self.tp_rank, sorted({s.request_id for s in dropped}),
                sorted({r for s in dropped for r in s.after_loads} & failed),
            )
            with self._lock:  # the scheduler delays their frees all the same
                self._saving.update(s.request_id for s in dropped)
        return saves, dropped

    def _done_saving(self, intents: Sequence[SaveIntent]) -> None:
        with self._lock:
            for s in intents:
                self._pending[s.request_id] -= 1
                if self._pending[s.request_id] <= 0:
                    del self._pending[s.request_id]
                    self._cut.pop(s.request_id, None)  # no job of it left to cut
            self._lock.notify_all()

    def _save_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._await_gate(job)
                self._save(job)
            except Exception:  # noqa: BLE001 - the save thread must outlive any one save
                # A bug or a CUDA error on the event: this step's saves are lost, never the
                # thread (a dead one left every later save queued and close() waiting).
                self._count("save_errors", 1)
                self._count("saves_dropped", sum(len(s.block_ids) for s in job.intents))
                log.exception("save of requests %s failed (dropped)", sorted({s.request_id for s in job.intents}))
                self._discard_lost(job, "the save thread's error above")
            finally:
                self._done_saving(job.intents)

    def _await_gate(self, job: _SaveJob) -> None:
        """Save thread: holds `job` until the worker's next step has launched its forward (its
        get_finished; SAVE_GATE_S), a preemption or close() flushes it, or save_gate_s passed."""
        if self.save_gate_s <= 0:
            return
        deadline = time.monotonic() + self.save_gate_s
        with self._lock:
            self._gate_at = job.ends + 2
            while self._ends < self._gate_at and job.seq > self._flush_seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            self._gate_at = -1

    def _flush_saves(self, upto: Optional[int] = None) -> None:
        """Lets every job queued so far (or up to seq `upto`) through the save gate."""
        with self._lock:
            self._flush_seq = max(self._flush_seq, self._save_seq if upto is None else upto)
            self._lock.notify_all()

    def _save(self, job: _SaveJob) -> None:
        if job.event is not None:
            job.event.synchronize()  # the step's KV writes are done before the server copies
        with self._lock:
            cut = [s for s in job.intents if job.seq <= self._cut.get(s.request_id, 0)]
        if cut:
            self._count("saves_dropped", sum(len(s.block_ids) for s in cut))
            job = replace(job, intents=[s for s in job.intents if s not in cut])  # its discard stays
            if not job.intents and not job.discard:
                return
        blocks = sum(len(s.block_ids) for s in job.intents)
        reg = self._reg()
        if not reg.connected:
            self._count("saves_dropped", blocks)
            self._discard_lost(job, "not connected to the server")
            return
        ids: List[int] = []
        hashes: List[bytes] = []
        for s in job.intents:
            ids.extend(s.block_ids)
            hashes.extend(s.block_hashes)
        try:
            r = self.client.save(
                instance_id=self.instance_id, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                block_ids=ids, block_hashes=hashes,
                request_id=job.intents[0].request_id if job.intents else job.discard_request,
                discard_hashes=job.discard,
            )
        except PegaflowError as e:
            self._count("saves_dropped", blocks)
            self._count("save_errors", 1)
            log.debug("save of %d blocks failed (dropped): %s", blocks, e)
            self._discard_lost(job, str(e))
            return
        if job.discard:
            self._count("saves_discarded", len(job.discard))
            self._count("blocks_discarded", r.blocks_discarded)
        if job.intents:
            self._count("saves", 1)
        self._count("blocks_saved", r.blocks_saved)
        self._count("blocks_skipped", r.blocks_skipped)
        self._count("blocks_refused", r.blocks_refused + r.blocks_not_admitted)

    def _abandon_queue(self) -> None:
        """close() leaves a stuck save thread: the jobs it never took are dropped here, their
        discards counted lost (never silently). The job it is in still ends on its own."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._count("saves_dropped", sum(len(s.block_ids) for s in job.intents))
                self._discard_lost(job, "the save thread was stuck at shutdown")
                self._done_saving(job.intents)

    def _discard_lost(self, job: _SaveJob, why: str) -> None:
        """The job's discard did not reach the server: the other ranks' saves of those blocks,
        computed over this rank's failed load, may stay there (counted, logged)."""
        if not job.discard:
            return
        self._count("discards_lost", len(job.discard))
        log.warning(
            "tp_rank %d: discard of %d blocks of request %s (computed over a failed load) not sent: %s",
            self.tp_rank, len(job.discard), job.discard_request, why,
        )

    def get_finished(self, finished_req_ids: Iterable[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(finished_sending, finished_recving): requests whose saves are all
        done (only those that had a save, as the scheduler delayed exactly
        those), and async loads that ended (ok or failed). A request that
        finished while its async load was landing is reported once, in
        finished_recving (vLLM frees it on either), even if it saved blocks
        before a preemption. Opens the save gate of the steps before this one."""
        self._ends += 1
        if 0 <= self._gate_at <= self._ends:
            with self._lock:
                self._lock.notify_all()
        if not finished_req_ids and not self._finishing and not self._lingering and not self._async_loads:
            return None, None  # most steps: nothing ended, nothing waits to be reported
        recving: Set[str] = set()
        self._poll_lingering()
        if self.mode == ASYNC:
            for rid, ld in list(self._async_loads.items()):
                if not ld.done and ld.state is not None:
                    # One read of the word: read twice, a copy ending in between read as pending,
                    # then settled, and the load was failed "ended with state 1" (recomputed).
                    s = ld.state.state
                    ok = None if s == STATE_PENDING else s > 0
                    if _unsettled_word(s):
                        gone = self._server_gone(ld) if ok is None else None
                        if ok is None and self._left(ld) > 0 and gone is None:
                            continue
                        if ok is None:
                            self._fail(ld, gone or f"not done after {self.load_timeout_s} s")
                        else:  # the answer of its Load was lost (already failed)
                            self._fail(ld, f"the answer of its Load was lost (state {ld.state.name})")
                        forgot = self._server_forgot(ld)
                        if not forgot and time.monotonic() < ld.at + self.load_timeout_s * LINGER_LOAD_TIMEOUTS:
                            continue  # its copy may still land: the request keeps its blocks
                        self._abandoned(ld, forgot)
                    else:
                        ld.done = True
                        if not ok:
                            self._fail(ld, f"load state {ld.state.name} ended with state {s}")
                recving.add(rid)
                self._recycle(ld)
                del self._async_loads[rid]
        if self._failed_loads and finished_req_ids:
            self._failed_loads.difference_update(finished_req_ids)
        with self._lock:
            self._finishing |= set(finished_req_ids) & self._saving
            # A finished request whose async load is still landing is freed by vLLM when it comes
            # back in finished_recving (its earlier saves, before a preemption, do not free it):
            # in finished_sending as well, its blocks would be freed under the load, then twice.
            freed = self._finishing & recving
            self._finishing -= freed
            self._saving -= freed
            sending = {r for r in self._finishing if not self._pending.get(r) and r not in self._async_loads}
            self._finishing -= sending
            self._saving -= sending
        return (sending or None), (recving or None)

    def take_load_errors(self) -> Set[int]:
        """The blocks of every load that failed so far, this step's included: asked before
        wait_for_save (vLLM's runner with a deferred finalize, speculative decoding), the
        step's layer-wise loads are settled here first, else a failure the GPU's waits let pass
        would be reported a step late, after a token computed over KV that never landed."""
        if self.step_loads:
            self._finish_step_loads()  # its failures are remembered (_failed_loads) for wait_for_save
        errs, self._errors = self._errors, set()
        return errs

    def stats_snapshot(self) -> Dict[str, int]:
        with self._lock:
            out = dict(self.stats)
        if self.registration is not None:
            out.update({"registration_" + k: v for k, v in self.registration.stats().items()})
        return out

    def close(self, unregister: bool = True) -> None:
        # A discard the full queue could not take waits for the next job; there is none now: it
        # goes as the last one, behind the saves queued before it.
        discard, discard_request = self._unsent_discard
        self._unsent_discard = ([], "")
        last = _SaveJob(None, [], self._save_seq + 1, discard, discard_request) if discard else None
        self._flush_saves(self._save_seq + 1)  # no step follows: the gate holds nothing back (`last` too)
        if self._thread is not None:
            wait = self.client.config.save_timeout_s
            try:
                if last is not None:
                    self._queue.put(last, timeout=wait)
                    last = None
                self._queue.put(None, timeout=wait)
                self._thread.join(wait)
            except queue.Full:  # the save thread is stuck: leave it (a daemon), never hang here
                log.warning("save thread still busy after %.1f s; closing without it", wait)
                self._abandon_queue()
            self._thread = None
        if last is not None:
            self._discard_lost(last, "the save thread could not take it at shutdown")
        if self.registration is not None:
            self.registration.close(unregister=unregister)
        if self.staging_registration is not None:
            self.staging_registration.close(unregister=unregister)
        # Unregistering drained the server's copies: every state can go now (a GPU wait on
        # one is let through first, and the stream drained, before its page is unregistered).
        loads = self.step_loads + list(self._async_loads.values()) + self._lingering
        if self._gpu is not None:
            for ld in loads:
                if ld.state is not None:
                    ld.state.release_waiters()
            self._gpu.reap(block=True)
            self._gpu.close()
        for ld in loads:
            if ld.state is not None:
                ld.state.close()
                ld.state = None
        self.step_loads, self._async_loads, self._lingering = [], {}, []
        for st in self._free_states:
            st.close()
        self._free_states.clear()
        if self.staging is not None:
            self.staging.close()
            self.staging = None

