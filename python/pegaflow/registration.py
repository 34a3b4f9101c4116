"""One rank's registration with the KV server, kept alive across server
restarts without restarting the engine.

`KvRegistration` holds everything RegisterContext needs (instance id,
namespace, ranks, device, layers in execution order with their handles and
geometry), registers once, then keeps the rank's Session stream open on a
background thread. When the stream ends (server killed or restarted, the
instance cleaned up, the connection lost) the rank is marked disconnected
and the thread re-registers the same regions with backoff until a server
answers, then opens a new session. The regions themselves (CUDA
allocations, shm files) outlive the server, so nothing on the engine side
changes. While disconnected, callers see `connected == False` and answer
queries with 0 hits and drop saves (counted), never an exception.

A server that is not up yet when the engine starts is the same case: the
first registration, refused only for want of a server (UNAVAILABLE,
DEADLINE_EXCEEDED), is left to the background thread and the engine starts
without PegaFlow until one answers (logged once). A refusal of the request
itself (bad layers, a topology mismatch) is still raised at once.

Retry rules: every failure of RegisterContext is retried with exponential
backoff (50 ms doubling to `config.reconnect_max_s`); ALREADY_EXISTS means
the server still holds this rank with these very regions (our stream broke,
the server's did not) and counts as registered. A rank held by another
engine under the same instance id (other regions: a process that crashed and
whose session the server has not seen end yet, or a second engine given the
same instance id) is refused with FAILED_PRECONDITION "... is registered by
another engine", and so is a rank whose engine id (its client's `engine_id`:
every rank of one engine sends its engine's, vLLM's kv_transfer_config.engine_id)
is not the one the instance was registered with, even for a rank the instance
has not registered yet: it is logged, never counted as registered and no session is
opened (the server would refuse it: a session presents its registration's
token); the rank retries, also from the first `register()`, and registers
once the holder is gone. The session presents the registration token the
server answered (RegisterContext, or the ALREADY_EXISTS message of the same
registration asked again). With the session open, RegisterContext goes once
more and must answer ALREADY_EXISTS (or register): the server that took the
session holds the rank too; one that registered the rank anew there (it
restarted in between) refused the session's old token, so the attempt counts
as failed and is retried with the new token. A SUPERSEDED event means a
session with this registration's own token took over (another process on the
same regions): that process owns the rank, so this one stops (connected stays
False) and logs why. The server cleans up a registered rank whose session
does not open within its grace period (`--session-grace-ms`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Sequence

import grpc

from ._proto import pegaflow_pb2 as pb
from .client import PegaflowClient, registration_token_in
from .errors import PegaflowError
from .regions import LayerRegion

log = logging.getLogger("pegaflow.registration")

RETRY_MIN_S = 0.05
#: A session that stood this long ended for a reason of its own (a restart, a cleanup), and the
#: rank re-registers at once; one that ended sooner waits a backoff that doubles per generation
#: (something on the path ends every session at once: without it, a loop with no pause).
SESSION_STOOD_S = 1.0
#: A registration refused for want of a server, not for its content: retried in the background.
NO_SERVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: What the server's refusal of a rank held by another engine says (lib/engine/registration.ts
#: `HELD_BY_ANOTHER_ENGINE`, the owner): FAILED_PRECONDITION with these words.
HELD_BY_ANOTHER_ENGINE = "is registered by another engine"


def held_by_another_engine(e: PegaflowError) -> bool:
    """True when RegisterContext was refused because another engine holds the rank under this
    instance id (other regions), or the instance (another engine_id): not registered, retried
    until the holder leaves."""
    return e.code == grpc.StatusCode.FAILED_PRECONDITION and HELD_BY_ANOTHER_ENGINE in e.details


def _event_text(ev: pb.SessionEvent) -> str:
    """A session event as words: its kind's name, or its number for a kind this client does not
    know (a newer server's; `Kind.Name` raised ValueError there, which ended the session thread:
    the rank was never registered again)."""
    kind = pb.SessionEvent.Kind
    name = kind.Name(ev.kind) if ev.kind in kind.values() else f"session event kind {ev.kind}"
    return name + (f": {ev.message}" if ev.message else "")


class _Closed(Exception):
    """close() ran while a session opened (KvRegistration._open_session)."""


class KvRegistration:
    """One rank's layers, registered and kept registered.

    Example:
        client = PegaflowClient(addr, engine_id=engine_id)  # the rank registers with its id
        layers, device = export_kv_layers(kv_caches)
        reg = KvRegistration(client, instance_id="inst", namespace=ns, layers=layers,
                             tp_rank=0, tp_size=1, device_id=device)
        reg.register()          # raises PegaflowError on bad input; no server yet: registers later
        reg.connected           # False while the server is away
        reg.close()             # unregisters and ends the session
    """

    def __init__(
        self,
        client: PegaflowClient,
        *,
        instance_id: str,
        namespace: str,
        layers: Sequence[LayerRegion],
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        device_id: int = 0,
    ):
        if not layers:
            raise ValueError(f'instance "{instance_id}" tp_rank {tp_rank}: no layers to register')
        self.client = client
        self.instance_id = instance_id
        self.namespace = namespace
        self.layers = list(layers)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.device_id = device_id
        self._index: Dict[str, int] = {l.name: i for i, l in enumerate(self.layers)}
        self._lock = threading.Lock()
        self._up = threading.Event()
        self._stop = threading.Event()
        self._session = None
        self._thread: Optional[threading.Thread] = None
        self.generation = 0
        self.superseded = False
        self.last_error: Optional[str] = None
        #: The token of this rank's registration on the server (RegisterContext's answer): what
        #: the session presents. None before the first answer (or from a server without tokens).
        self.registration_token: Optional[str] = None
        self._stats = {"registrations": 0, "disconnects": 0, "register_failures": 0}
        # RegisterContexts answered with a new registration (not ALREADY_EXISTS): see registered_anew.
        self._anew = 0
        # RegisterContexts begun (numbered from 1 as they are sent), and the number of the latest
        # one answered with a new registration: see registrations_begun, registered_anew_since.
        self._begun = 0
        self._anew_at = 0

    # ---- facts --------------------------------------------------------------

    @property
    def who(self) -> str:
        return f'instance "{self.instance_id}" tp_rank {self.tp_rank} pp_rank {self.pp_rank}'

    @property
    def layer_names(self) -> List[str]:
        return [l.name for l in self.layers]

    def layer_index(self, name: str) -> int:
        """Position of a layer in registration order (= the load state's layer index)."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f'{self.who}: layer "{name}" is not registered') from None

    @property
    def connected(self) -> bool:
        return self._up.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        return self._up.wait(timeout_s)

    @property
    def sessions_lost(self) -> int:
        """How many times this rank's session ended. A Load sent before a change went to a server
        whose session with this rank is gone: it died, or it is cleaning the instance up."""
        return self._stats["disconnects"]

    @property
    def registered_anew(self) -> int:
        """How many RegisterContexts made a new registration of this rank (the first one
        included). Not what tells a load's server gone: a registration answered after a load
        began may be the very one that took its Load (`registered_anew_since`)."""
        return self._anew

    @property
    def registrations_begun(self) -> int:
        """How many RegisterContexts of this rank were begun (sent, or about to be): the mark a
        load takes when it begins, for `registered_anew_since`."""
        return self._begun

    def registered_anew_since(self, begun: int) -> bool:
        """Whether a RegisterContext begun after `registrations_begun` read `begun` made a new
        registration of this rank. Then the registration that took any Load whose lease was
        granted before that mark is gone from the server that answered: that server died (its
        copies with it), or it cleaned the instance up, which drains the instance's copies first
        (a lease dies with its instance: no later registration takes such a Load). No byte of it
        lands any more. A registration begun before the mark and answered after it does not
        count: it may be the one that took the Load (the server registered the rank, a query
        hit, the scheduler sent the Load, all before this rank's thread took the answer in), and
        counting it let such a load go while its copy ran."""
        return self._anew_at > begun

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._stats, generation=self.generation, connected=int(self.connected))

    # ---- lifecycle ----------------------------------------------------------

    def _register_once(self) -> pb.RegisterContextResponse:
        """RegisterContext; keeps the registration token it answers (also the one an
        ALREADY_EXISTS names: the server holds this very registration)."""
        with self._lock:
            self._begun += 1
            seq = self._begun
        try:
            res = self.client.register_context(
                instance_id=self.instance_id,
                namespace=self.namespace,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                pp_rank=self.pp_rank,
                pp_size=self.pp_size,
                device_id=self.device_id,
                layer_names=self.layer_names,
                region_handles=[l.handle for l in self.layers],
                geometry=[l.geometry for l in self.layers],
            )
        except PegaflowError as e:
            self.registration_token = registration_token_in(e) or self.registration_token
            raise
        self.registration_token = res.registration_token or None
        with self._lock:
            self._anew += 1
            self._anew_at = max(self._anew_at, seq)
        return res

    def register(self) -> Optional[pb.RegisterContextResponse]:
        """First registration, then the session thread starts and keeps it alive. A refusal
        of the request is raised; with no server to answer (UNAVAILABLE, DEADLINE_EXCEEDED),
        or the rank held by another engine, the thread registers once it can, and this
        returns None (`connected` is False, `last_error` says why)."""
        if self._thread is not None:
            raise RuntimeError(f"{self.who}: register() called twice")
        name = f"pegaflow-session-{self.tp_rank}-{self.pp_rank}"
        try:
            try:
                res = self._register_once()
            except PegaflowError as e:
                if e.code != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                # The server still holds this very registration (an earlier KvRegistration of
                # these regions, closed without unregistering): registered, with the token the
                # refusal names (kept by _register_once).
                res = pb.RegisterContextResponse(registration_token=self.registration_token or "")
            self._open_session()
        except PegaflowError as e:
            held = held_by_another_engine(e)
            if e.code not in NO_SERVER and not held:
                raise
            self.last_error = str(e)
            if held:
                log.error(
                    "%s (engine_id %r): another engine holds this rank or its instance (%s); running without "
                    "PegaFlow, retrying until it leaves",
                    self.who, self.client.engine_id, e,
                )
            else:
                log.warning("%s: no KV server answers (%s); running without PegaFlow until one does", self.who, e)
            self._thread = threading.Thread(target=self._register_later, name=name, daemon=True)
            self._thread.start()
            return None
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()
        return res

    def _register_later(self) -> None:
        """The first registration, once a server answers; then the session watch."""
        if self._reregister():
            self._watch()

    def _open_session(self) -> bool:
        """Opens and installs the rank's session; False (cancelled) when close() ran meanwhile.
        Raises PegaflowError (the session cancelled) when the server that took the session
        cannot be shown to hold the rank (`_confirm_held`)."""
        token = self.registration_token
        session = self.client.open_session(self.instance_id, self.tp_rank, self.pp_rank, registration_token=token)
        try:
            if self._stop.is_set():
                raise _Closed()  # close() ran meanwhile: register nothing again
            self._confirm_held()
            if self.registration_token != token:
                # The server registered the rank anew (it restarted after our RegisterContext): it
                # refused the session's old token. Retried (the backoff loop) with the new one.
                raise PegaflowError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self.who}: the server registered the rank anew while its session opened; retrying",
                    "Session",
                )
        except (PegaflowError, _Closed):
            session.cancel()
            if self._stop.is_set():
                return False  # closed meanwhile (its old session's end may be what this saw)
            raise
        with self._lock:
            # close() may have run since the caller checked: never install (and leak) a
            # session past it, nor read connected after it.
            if self._stop.is_set():
                session.cancel()
                return False
            self._session = session
            self.generation += 1
            self._stats["registrations"] += 1
            self._up.set()
            return True

    def _confirm_held(self) -> None:
        """RegisterContext once more, with the session open: ALREADY_EXISTS (or a registration
        now, after a restart) means the server the calls reach holds the rank, and a server
        that took the session before a restart breaks it. Without this, a server restarted
        between RegisterContext and Session took the session (it takes one for any instance)
        without the registration: the rank read connected while its every call failed "not
        registered", until the next restart. Raises PegaflowError for any other answer."""
        try:
            self._register_once()
        except PegaflowError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise

    def _watch(self) -> None:
        gap = 0.0  # the pause before re-registering after a session that ended at once
        while not self._stop.is_set():
            since = time.monotonic()
            ev = self._session.next_event()
            if self._stop.is_set():
                return
            self._up.clear()
            with self._lock:
                self._stats["disconnects"] += 1
            why = (
                _event_text(ev)
                if ev is not None
                else (str(self._session.error) if self._session.error else "stream ended")
            )
            self.last_error = why
            if ev is not None and ev.kind == pb.SessionEvent.SUPERSEDED:
                self.superseded = True
                log.error("%s: another process took over this rank's session (%s); not re-registering", self.who, why)
                return
            log.warning("%s: session lost (%s); re-registering when the server is back", self.who, why)
            stood = time.monotonic() - since >= SESSION_STOOD_S
            gap = 0.0 if stood else min(max(gap * 2, RETRY_MIN_S), self.client.config.reconnect_max_s)
            if self._stop.wait(gap) or not self._reregister():
                return  # its session is gone for good: waiting on it again would spin

    def _reregister(self) -> bool:
        """Registers again once the server is back; False when it never will (the client
        was closed, or close() stopped it)."""
        delay = RETRY_MIN_S
        cap = self.client.config.reconnect_max_s
        while not self._stop.is_set():
            if self.client.closed:
                self.last_error = "the client was closed; not re-registering"
                log.warning("%s: %s", self.who, self.last_error)
                return False
            fresh = False
            try:
                self._register_once()
                ok = fresh = True
            except PegaflowError as e:
                ok = e.code == grpc.StatusCode.ALREADY_EXISTS
                if not ok:
                    with self._lock:
                        self._stats["register_failures"] += 1
                    # A server that refuses the request itself (not a server away) is worth a
                    # warning, once per reason: it will not go away by retrying alone.
                    if e.code not in NO_SERVER and str(e) != self.last_error:
                        log.warning("%s: registration refused (retrying): %s", self.who, e)
                    else:
                        log.debug("%s: re-registration failed: %s", self.who, e)
                    self.last_error = str(e)
            if fresh and self._stop.is_set():
                self._undo_late_registration()
                return False
            if ok and not self._stop.is_set():
                try:
                    if not self._open_session():
                        return False  # closed meanwhile: not re-registered after all
                    log.info("%s: re-registered (generation %d)", self.who, self.generation)
                    return True
                except PegaflowError as e:  # the server went away again, or the client closed
                    self.last_error = str(e)
                    if self.client.closed:
                        return False
                    with self._lock:
                        self._stats["register_failures"] += 1
                    log.debug("%s: re-registration failed after its session opened: %s", self.who, e)
            self._stop.wait(delay)
            delay = min(delay * 2, cap)
        return False

    def _undo_late_registration(self) -> None:
        """close() ran while a RegisterContext was on its way: it found the rank not connected
        and unregistered nothing, and no session will ever end this registration, so the server
        would keep the instance (and its mapped regions) for good. Undone here instead, as
        close() would have done (a session's end cleans the instance up the same way)."""
        try:
            self.client.unregister_context(self.instance_id)
            log.info("%s: registered after close(); unregistered it again", self.who)
        except PegaflowError as e:
            log.warning("%s: registered after close() and could not unregister it: %s", self.who, e)

    def close(self, unregister: bool = True) -> None:
        """Stops the session thread; with `unregister`, cleans the instance
        up on the server first (ignored when the server is away)."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()  # under the lock: a session being opened now is cancelled there
        if unregister and self.connected:
            try:
                self.client.unregister_context(self.instance_id)
            except PegaflowError as e:
                log.info("%s: unregister on close failed: %s", self.who, e)
        self._up.clear()
        if self._session is not None:
            self._session.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.client.config.rpc_timeout_s)
