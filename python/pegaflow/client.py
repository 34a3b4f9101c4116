"""The gRPC client of the PegaFlow KV server: one method per RPC of
`pegaflow.Engine` (proto/pegaflow.proto), each with a deadline, failures
raised as `PegaflowError(code, details, method)`.

The channel is created on first use and again after a fork (vLLM spawns its
workers; a gRPC channel must never cross a fork). No call waits for the
server to come up (no wait_for_ready): a dead server answers UNAVAILABLE at
once, a wedged one hits the deadline, so an engine never hangs on us. After an
UNAVAILABLE one background thread waits (wait_for_ready, with a deadline) for
the channel to come back, which is what makes grpcio reconnect at once when the
server is up again (`_reconnect_soon`). A call that never left this process (no
server could be reached, or the client was closed) raises `CallNotSent`.

Where the address is unix:/path and the server serves its local RPC socket
beside it (`path.rpc`, see local_rpc.py), QueryPrefetch, WaitPrefetch, Load,
Release, Save and Health go over that socket instead: the same messages, codes and deadlines,
without grpcio's thread hop and HTTP/2 on the warm request's path.

The service stubs are written here by hand (`channel.unary_unary` with the
generated messages' serializers) because CI has no grpc_tools plugin.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import grpc

from ._proto import pegaflow_pb2 as pb
from .config import ClientConfig
from .errors import PegaflowError
from .local_rpc import METHOD_IDS, LocalRpc, LocalRpcAbsent, LocalRpcNotSent, LocalRpcStatus

log = logging.getLogger("pegaflow.client")

#: The protocol version RegisterContext expects (HealthResponse.version); mirrors
#: lib/engine/registration.ts `PROTOCOL_VERSION` (pegaflow-2: the Session presents the registration
#: token, so a client from before tokens is refused at RegisterContext, not at its Session).
PROTOCOL_VERSION = "pegaflow-2"
#: Lease ids are 16 bytes (lib/limits.ts LEASE_ID_BYTES; tests/native/abi_mirror_test.ts
#: checks that the two agree).
LEASE_ID_BYTES = 16
#: The longest WaitPrefetch hold the server accepts, in ms (lib/limits.ts MAX_PREFETCH_WAIT_MS;
#: tests/native/abi_mirror_test.ts checks that the two agree).
MAX_PREFETCH_WAIT_MS = 60000
#: Keepalive pings wait this long for an answer before the connection is declared dead.
KEEPALIVE_TIMEOUT_S = 20.0
#: First reconnect attempt of the channel after a drop (gRPC's default is 1 s).
MIN_RECONNECT_BACKOFF_MS = 100
#: The longest pause of the reconnect thread between two Health calls a server refused at once
#: (`_drive_reconnect`; `reconnect_max_ms` when less): a stopping server is asked about once a
#: second, and the thread is back in a wait_for_ready call within that when its successor is up.
RECONNECT_PAUSE_MAX_S = 1.0

_SERVICE = "/pegaflow.Engine/"
#: After finding no local RPC socket, calls use gRPC this long before it is tried again.
LOCAL_RPC_RETRY_S = 1.0
#: A status number from the local RPC socket as grpcio's enum (the same numbering).
_STATUS_BY_CODE = {c.value[0]: c for c in grpc.StatusCode}


#: The wire tag (field number, length-delimited) of `block_hashes` in QueryPrefetchRequest and
#: SaveRequest, read from the schema (proto/pegaflow.proto owns the number).
_HASHES_TAG = {
    name: (getattr(pb, name).DESCRIPTOR.fields_by_name["block_hashes"].number << 3) | 2
    for name in ("QueryPrefetchRequest", "SaveRequest")
}


def _hashes_field(message: str, hashes: Sequence[bytes]) -> Optional[bytes]:
    """`repeated bytes block_hashes` of `message` on the wire, when every hash has one length
    below 128 (each entry is then the same two header bytes and the hash: one C-level join,
    where 639 appends to the message cost ~0.3 ms of a warm request's Python on a cold cache).
    Serialized protobuf messages concatenate as a merge, so the caller appends this to the
    rest of the request. None (build it in the message) for anything else.

    Example:
        _hashes_field("QueryPrefetchRequest", [b"\x01" * 16]) == b"\x12\x10" + b"\x01" * 16
    """
    if not hashes:
        return b""
    try:
        sizes = set(map(len, hashes))
    except TypeError:
        return None
    if len(sizes) != 1 or not 0 < (n := sizes.pop()) < 128:
        return None
    sep = bytes((_HASHES_TAG[message], n))
    try:
        wire = sep + sep.join(hashes)
    except TypeError:  # not bytes-like: the message's own check names it
        return None
    # len() counts items, the join takes buffer bytes: they differ for wider items (an int
    # array), whose entries would not match their length bytes.
    return wire if len(wire) == len(hashes) * (n + 2) else None


def _put_hashes(req, hashes: Iterable[bytes]) -> bytes:
    """`hashes` (any iterable, read once) as `req`'s block_hashes: the wire bytes to append to
    the serialized `req` (`_hashes_field`), or b"" after adding them to `req` itself."""
    if not isinstance(hashes, (list, tuple)):
        hashes = list(hashes)
    tail = _hashes_field(req.DESCRIPTOR.name, hashes)
    if tail is None:
        req.block_hashes.extend(bytes(h) for h in hashes)
        return b""
    return tail


#: How the server's ALREADY_EXISTS (the same registration again) names the rank's registration
#: token (lib/server/grpc_service.ts `withToken`): a holder whose first answer was lost learns it.
REGISTRATION_TOKEN_IN_DETAILS = re.compile(r"\(registration token ([0-9a-f]+)\)")
#: A Session ended with these was refused: it never stood for a registration.
REFUSED_SESSION = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
#: The response header the server sends at once when it takes a Session (lib/engine/registration.ts
#: `SESSION_TAKEN_HEADER`, the owner). grpcio shows an empty header block and none alike: only this
#: header tells a session that stood for its registration from one that never reached the server.
SESSION_TAKEN_HEADER = "pegaflow-session-taken"


def registration_token_in(e: PegaflowError) -> Optional[str]:
    """The registration token an ALREADY_EXISTS refusal of RegisterContext names, else None."""
    m = REGISTRATION_TOKEN_IN_DETAILS.search(e.details or "")
    return m.group(1) if e.code == grpc.StatusCode.ALREADY_EXISTS and m else None


class CallNotSent(PegaflowError):
    """A failed call that never left this process: no connection to a server could be made (a
    server down or restarting), or the client was closed. Unlike other UNAVAILABLE or CANCELLED
    failures, no server saw it, so nothing it asked for (a Load's copy, a query's loads) happens:
    what it would have written needs no holding (connector/lifecycle.py `maybe_accepted`)."""


#: How grpcio fails a call it could not give to any connection (its load balancer's pick, before
#: anything is sent; grpc core's pick_first), e.g. "failed to connect to all addresses; last error:
#: UNKNOWN: ipv4:127.0.0.1:50055: Failed to connect to remote host: Connection refused". A failure
#: without it is taken as one that may have reached the server.
GRPC_NO_CONNECTION = "failed to connect to all addresses"


def _grpc_error(code: grpc.StatusCode, details: str, method: str) -> PegaflowError:
    """A failed gRPC call as PegaflowError (CallNotSent when grpcio never sent it)."""
    if code == grpc.StatusCode.UNAVAILABLE and GRPC_NO_CONNECTION in details:
        return CallNotSent(code, details, method)
    return PegaflowError(code, details, method)


def _closed_error(method: str) -> PegaflowError:
    """What a call on a closed client raises. grpcio itself raises ValueError ("Cannot invoke
    RPC on closed channel!") for a call that close() on another thread overtook between the stub
    look-up and the invocation: the engine must see the same CANCELLED, not a ValueError."""
    return CallNotSent(grpc.StatusCode.CANCELLED, "client is closed", method)


def _local_error(code: int, details: str, method: str, sent: bool = True) -> PegaflowError:
    """A local RPC socket's non-OK status as the PegaflowError gRPC would have raised
    (CallNotSent when it never left this process)."""
    status = _STATUS_BY_CODE.get(code, grpc.StatusCode.UNKNOWN)
    return PegaflowError(status, details, method) if sent else CallNotSent(status, details, method)


def _drive_reconnect(
    client: "weakref.ref[PegaflowClient]", ch: grpc.Channel, stop: threading.Event, rpc_timeout_s: float,
    reconnect_max_s: float,
) -> None:
    """The `pegaflow-reconnect` thread (PegaflowClient._reconnect_soon): Health with
    wait_for_ready on `ch`, again until it is answered (the channel is up) or the client is
    closed (the call is cancelled, `stop` set) or gone. Each call wakes this thread once per RPC
    deadline while the server is away; a wedged server (connected, never answering) is asked
    once per deadline until it answers. A Health that fails UNAVAILABLE at once (a server that
    is stopping refuses every call so until it exits, Health too; a connection that broke under
    the call) is asked again only after a pause, doubling from MIN_RECONNECT_BACKOFF_MS to
    RECONNECT_PAUSE_MAX_S (`reconnect_max_ms` when less): without one this thread asked a
    stopping server thousands of times a second (a core of the engine, and the server's event
    loop while it drained). It holds the client weakly: a client dropped without close() while
    its server was away once kept its thread and channel for good."""
    health = ch.unary_unary(
        _SERVICE + "Health",
        request_serializer=pb.HealthRequest.SerializeToString,
        response_deserializer=pb.HealthResponse.FromString,
    )
    pause = MIN_RECONNECT_BACKOFF_MS / 1000
    cap = max(min(reconnect_max_s, RECONNECT_PAUSE_MAX_S), pause)
    while True:
        c = client()
        if c is None or c.closed:
            return
        del c
        asked = time.monotonic()
        try:
            health(pb.HealthRequest(), timeout=rpc_timeout_s, wait_for_ready=True)
            return
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                return  # answered (the channel is up), or cancelled (closed)
        except ValueError:  # the channel was closed between two calls
            return
        # A call that waited its whole deadline is asked again at once; one that failed sooner,
        # after what is left of the pause.
        if stop.wait(max(0.0, pause - (time.monotonic() - asked))):
            return  # closed
        pause = min(pause * 2, cap)


@dataclass(frozen=True)
class Geometry:
    """Where one layer's blocks live in its region, in bytes:
    `addr(block, seg) = base_offset + block * block_stride + seg * seg_stride`,
    `seg_bytes` per segment, `num_segments` per block, inside a region of
    `region_bytes` bytes (mirror of the proto's LayerGeometry)."""

    num_blocks: int
    block_stride: int
    seg_stride: int
    seg_bytes: int
    num_segments: int
    base_offset: int
    region_bytes: int

    def to_proto(self) -> pb.LayerGeometry:
        return pb.LayerGeometry(
            num_blocks=self.num_blocks,
            block_stride=self.block_stride,
            seg_stride=self.seg_stride,
            seg_bytes=self.seg_bytes,
            num_segments=self.num_segments,
            base_offset=self.base_offset,
            region_bytes=self.region_bytes,
        )


@dataclass(frozen=True)
class QueryResult:
    """A QueryPrefetch answer: `loading` (a lower tier is fetching the prefix:
    ask again with the same request id), or `hits` blocks pinned under
    `lease_id` (empty when hits == 0) for `ttl_ms`."""

    loading: bool
    hits: int = 0
    lease_id: bytes = b""
    ttl_ms: int = 0
    # With load_into and a hit: each rank's load in the order named.
    loads: List["RankLoadOutcome"] = field(default_factory=list)

    @property
    def load_errors(self) -> List[str]:
        """Why each refused rank load was refused (empty: every rank's load was queued)."""
        return [f"tp_rank {o.tp_rank} pp_rank {o.pp_rank}: {o.error}" for o in self.loads if o.error]


@dataclass(frozen=True)
class RankLoadOutcome:
    """One rank's load of a query-and-load: `error` empty = checked and queued (its load state
    reports the copy or a later refusal)."""

    tp_rank: int
    pp_rank: int
    error: str
    num_blocks: int


class Session:
    """An open liveness stream for one rank. The server sends nothing until
    the instance is cleaned up, superseded or the server stops; when this
    side goes away (cancel, process exit) the server cleans the instance up.

    Example:
        s = client.open_session("inst-a", tp_rank=0)
        ev = s.next_event()   # blocks; None = the stream broke or ended
    """

    def __init__(self, call: grpc.Call, on_end: Optional[Callable[["Session", Optional[pb.SessionEvent]], None]] = None):
        self._call = call
        self._on_end = on_end
        #: Why the stream ended, when it ended with an error.
        self.error: Optional[PegaflowError] = None
        #: Once the stream ended: whether the server had taken it (its headers came). A session
        #: that was refused, or never reached the server, stood for no registration.
        self.taken = False

    def _headers_say_taken(self) -> bool:
        """Waits for the stream's headers (or its end) and says whether the server took it."""
        md = self._call.initial_metadata() or ()
        return any(k == SESSION_TAKEN_HEADER for k, _ in md)

    def wait_taken(self, timeout_s: float) -> Optional[bool]:
        """Whether the server took this session: True once its headers came (the server sends
        them at once), False once the stream ended without them (refused, or it never reached
        the server: see `error`), None when neither happened within `timeout_s`."""
        box: List[bool] = []
        t = threading.Thread(target=lambda: box.append(self._headers_say_taken()), daemon=True)
        t.start()
        t.join(timeout_s)
        return box[0] if box else None

    def next_event(self) -> Optional[pb.SessionEvent]:
        """The next event, or None when the stream ended (the server closed it
        or the connection broke; see `error`)."""
        try:
            ev = next(self._call)
        except StopIteration:
            ev = None
        except grpc.RpcError as e:
            self.error = PegaflowError(e.code(), e.details() or "", "Session")
            ev = None
        self._ended(ev)
        return ev

    def cancel(self) -> None:
        """Ends the session from this side (the server then cleans the instance up)."""
        self._call.cancel()
        self._ended(None)

    def _ended(self, ev: Optional[pb.SessionEvent]) -> None:
        f, self._on_end = self._on_end, None
        if f is None:
            return
        # The stream has ended: its headers (if any came) are in, reading them does not wait.
        self.taken = ev is not None or self._headers_say_taken()
        f(self, ev)


class PegaflowClient:
    """A connection to one KV server. Thread-safe; every call has a deadline.

    Args are the `ClientConfig` knobs (None = `PEGAFLOW_*` env, else default):
    `addr` ("host:port" or "unix:/path"), `rpc_timeout_ms`, `save_timeout_ms`,
    `reconnect_max_ms`, `keepalive_ms`; or pass a resolved `config`.

    `engine_id`: the engine incarnation this client speaks for, the same on every rank of one
    engine (vLLM's `kv_transfer_config.engine_id`; the connector passes `engine_id_of`'s).
    RegisterContext, Save, QueryPrefetch and Load carry it, and while an instance exists the
    server refuses a rank or a request of another engine id under it (FAILED_PRECONDITION,
    "... is registered by another engine"). "" (the default) is not checked. Those four calls
    take `engine_id=` too: None (the default) sends the client's, anything else (also "") is
    sent instead for that one call, as a test acting as two engines through one client does.

    Example:
        c = PegaflowClient("127.0.0.1:50055")
        print(c.health().version)   # "pegaflow-2"
        c.close()
    """

    def __init__(
        self,
        addr: Optional[str] = None,
        *,
        rpc_timeout_ms: Optional[int] = None,
        save_timeout_ms: Optional[int] = None,
        reconnect_max_ms: Optional[int] = None,
        keepalive_ms: Optional[int] = None,
        config: Optional[ClientConfig] = None,
        engine_id: str = "",
    ):
        self.config = config or ClientConfig.resolve(
            addr=addr,
            rpc_timeout_ms=rpc_timeout_ms,
            save_timeout_ms=save_timeout_ms,
            reconnect_max_ms=reconnect_max_ms,
            keepalive_ms=keepalive_ms,
        )
        self._engine_id = engine_id
        self._lock = threading.Lock()
        self._channel: Optional[grpc.Channel] = None
        self._pid = -1
        self._stubs: dict = {}
        self._closed = False
        # While the channel is down: the channel, the thread that drives its reconnection
        # (`_reconnect_soon`) and the event close() sets to end that thread's pause.
        self._reconnect: Optional[Tuple[grpc.Channel, threading.Thread, threading.Event]] = None
        # The hot calls go over the server's local RPC socket when there is one (unix:
        # address, same host); gRPC carries the rest, and these too where it is absent.
        rpc_path = self.config.local_rpc_path()
        self._local: Optional[LocalRpc] = (
            LocalRpc(rpc_path, self.config.max_message_bytes) if rpc_path is not None else None
        )
        self._local_retry_at = 0.0  # after a missing socket: gRPC until then
        # The registration token this client was answered per rank (instance, tp, pp): what
        # open_session presents, so the session stands for this client's registration.
        self._tokens: Dict[Tuple[str, int, int], str] = {}

    @property
    def address(self) -> str:
        return self.config.addr

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def engine_id(self) -> str:
        """The engine id every RegisterContext, Save, QueryPrefetch and Load carries unless the
        call names another ("" = none: not checked by the server)."""
        return self._engine_id

    def _engine(self, override: Optional[str]) -> str:
        """The engine id a request carries: the call's `engine_id=` when given, else the client's."""
        return self._engine_id if override is None else override

    # ---- channel ------------------------------------------------------------

    def _options(self) -> list:
        c = self.config
        keepalive_ms = int(c.keepalive_s * 1000)
        return [
            ("grpc.max_send_message_length", c.max_message_bytes),
            ("grpc.max_receive_message_length", c.max_message_bytes),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", int(min(KEEPALIVE_TIMEOUT_S * 1000, keepalive_ms))),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", MIN_RECONNECT_BACKOFF_MS),
            ("grpc.min_reconnect_backoff_ms", MIN_RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", int(c.reconnect_max_s * 1000)),
            # Our callers decide about retries (a dropped save is counted, not replayed).
            ("grpc.enable_retries", 0),
        ]

    def _stub(self, method: str, req_cls, res_cls, stream: bool = False):
        with self._lock:
            if self._closed:
                raise _closed_error(method)
            pid = os.getpid()
            if self._channel is None or self._pid != pid:
                # After a fork the parent's channel (and its threads) is unusable:
                # leave it to the parent and open our own.
                self._channel = grpc.insecure_channel(self.config.addr, options=self._options())
                self._pid = pid
                self._stubs = {}
            stub = self._stubs.get(method)
            if stub is None:
                make = self._channel.unary_stream if stream else self._channel.unary_unary
                stub = make(
                    _SERVICE + method,
                    request_serializer=req_cls.SerializeToString,
                    response_deserializer=res_cls.FromString,
                )
                self._stubs[method] = stub
            return stub

    def _call(self, method: str, req, res_cls, timeout_s: Optional[float] = None, tail: bytes = b""):
        """`tail`: more fields of `req`, already on the wire (appended: a merge)."""
        t = timeout_s if timeout_s is not None else self.config.rpc_timeout_s
        local = self._usable_local()
        if local is not None and method in METHOD_IDS:
            try:
                return res_cls.FromString(local.call(METHOD_IDS[method], req.SerializeToString() + tail, t))
            except LocalRpcAbsent:
                self._local_absent()
            except LocalRpcStatus as e:
                raise _local_error(e.code, e.details, method, not isinstance(e, LocalRpcNotSent)) from None
        if tail:
            req.MergeFromString(tail)
        stub = self._stub(method, type(req), res_cls)
        try:
            return stub(req, timeout=t)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._reconnect_soon()
            raise _grpc_error(e.code(), e.details() or "", method) from None
        except ValueError:
            if not self._closed:
                raise
            raise _closed_error(method) from None

    # ---- RPCs ---------------------------------------------------------------

    def health(self, timeout_s: Optional[float] = None) -> pb.HealthResponse:
        """Server status, protocol version and backend ("cuda" | "host")."""
        return self._call("Health", pb.HealthRequest(), pb.HealthResponse, timeout_s)

    def register_context(
        self,
        *,
        instance_id: str,
        namespace: str,
        tp_rank: int,
        tp_size: int,
        pp_rank: int = 0,
        pp_size: int = 1,
        world_size: Optional[int] = None,
        device_id: int = 0,
        layer_names: Sequence[str],
        region_handles: Sequence[bytes],
        geometry: Sequence[Geometry],
        client_version: str = PROTOCOL_VERSION,
        engine_id: Optional[str] = None,
    ) -> pb.RegisterContextResponse:
        """Registers every layer of one rank (layer order = execution order), with the client's
        `engine_id` (or the call's: see the class); while the instance exists the server refuses a
        rank of another one ("... is registered by another engine"). "" is not checked."""
        req = pb.RegisterContextRequest(
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            world_size=world_size if world_size is not None else tp_size * pp_size,
            device_id=device_id,
            layer_names=list(layer_names),
            region_handles=[bytes(h) for h in region_handles],
            geometry=[g.to_proto() for g in geometry],
            client_version=client_version,
            engine_id=self._engine(engine_id),
        )
        rank = (instance_id, tp_rank, pp_rank)
        try:
            res = self._call("RegisterContext", req, pb.RegisterContextResponse)
        except PegaflowError as e:
            token = registration_token_in(e)
            if token is not None:  # the same registration again: the server still holds it
                self._tokens[rank] = token
            raise
        if res.registration_token:
            self._tokens[rank] = res.registration_token
        return res

    def save(
        self,
        *,
        instance_id: str,
        tp_rank: int,
        pp_rank: int = 0,
        block_ids: Sequence[int] = (),
        block_hashes: Sequence[bytes] = (),
        layers: Optional[Iterable[pb.LayerSave]] = None,
        request_id: str = "",
        timeout_s: Optional[float] = None,
        engine_id: Optional[str] = None,
        discard_hashes: Iterable[bytes] = (),
    ) -> pb.SaveResponse:
        """Saves `block_ids` (with their `block_hashes`) of every registered
        layer of the rank, or per-layer `layers`; returns once the bytes are in
        the pool (hence its own, longer deadline). It carries the client's
        `engine_id` (or the call's: see the class); the server refuses another
        engine's ("... is registered by another engine"). "" is not checked.

        `discard_hashes`: hashes whose KV this rank computed over a load that failed on it. The
        server drops (or evicts) their blocks, whatever ranks saved them, and refuses saves of
        them for a while (`SaveResponse.blocks_discarded`, proto/pegaflow.proto). A Save may
        carry only these (no `block_ids`). An older server ignores them."""
        req = pb.SaveRequest(
            instance_id=instance_id,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            block_ids=list(block_ids),
            layers=list(layers or ()),
            request_id=request_id,
            engine_id=self._engine(engine_id),
            discard_hashes=[bytes(h) for h in discard_hashes],
        )
        tail = _put_hashes(req, block_hashes)
        return self._call(
            "Save", req, pb.SaveResponse,
            timeout_s if timeout_s is not None else self.config.save_timeout_s, tail,
        )

    def query_prefetch(
        self, *, instance_id: str, block_hashes: Sequence[bytes], request_id: str,
        timeout_s: Optional[float] = None,
        load_into: Optional[Sequence[int]] = None,
        load_states: Optional[Mapping[Tuple[int, int], str]] = None,
        engine_id: Optional[str] = None,
    ) -> QueryResult:
        """Longest held prefix of `block_hashes`; a hit is pinned under a lease.

        Query and load: with `load_into` (one target block per hash) and
        `load_states` ((tp_rank, pp_rank) → load-state name, every rank of the
        instance), a hit's load of every rank starts before the answer; the
        lease is then spent (`result.loads` says how each rank's went).

        The query carries the client's `engine_id` (or the call's: see the class); the server
        refuses another engine's (FAILED_PRECONDITION, "... is registered by another engine")
        before it leases or loads anything. "" is not checked."""
        req = pb.QueryPrefetchRequest(
            instance_id=instance_id, request_id=request_id, engine_id=self._engine(engine_id)
        )
        tail = _put_hashes(req, block_hashes)
        if load_into is not None:
            if not load_states:
                raise ValueError("query_prefetch: load_into needs load_states (every rank's load state)")
            req.load_into.block_ids.extend(load_into)
            for (tp_rank, pp_rank), name in load_states.items():
                req.load_into.ranks.add(tp_rank=tp_rank, pp_rank=pp_rank, load_state_shm=name)
        r = self._call("QueryPrefetch", req, pb.QueryPrefetchResponse, timeout_s, tail)
        if r.WhichOneof("result") == "ready":
            return QueryResult(
                loading=False,
                hits=r.ready.num_hit_blocks,
                lease_id=bytes(r.ready.lease_id),
                ttl_ms=r.ready.lease_ttl_ms,
                loads=[RankLoadOutcome(o.tp_rank, o.pp_rank, o.error, o.num_blocks) for o in r.ready.loads],
            )
        return QueryResult(loading=True)

    def wait_prefetch(
        self, *, instance_id: str, request_id: str, wait_ms: int,
        timeout_s: Optional[float] = None, engine_id: Optional[str] = None,
    ) -> bool:
        """After a "loading" answer: blocks until the lower tier's fetch of `request_id` ended
        (True: ask `query_prefetch` again, RAM answers; also when none runs) or `wait_ms`
        (1..60000) passed while it still runs (False). Takes no lease. The call's deadline is
        `timeout_s` (default the client's) plus `wait_ms`."""
        req, t = self._wait_request(instance_id, request_id, wait_ms, engine_id, timeout_s)
        return self._call("WaitPrefetch", req, pb.WaitPrefetchResponse, t).settled

    def wait_prefetch_nowait(
        self, *, instance_id: str, request_id: str, wait_ms: int,
        on_done: Callable[[Optional[bool], Optional[PegaflowError]], None],
        timeout_s: Optional[float] = None, engine_id: Optional[str] = None,
    ) -> None:
        """`wait_prefetch` without blocking: `on_done(settled, None)` or `on_done(None, error)`
        runs on a reader thread once the server answers (a scheduler that must not block
        its step asks again when it ran). Same deadline as `wait_prefetch`."""
        req, t = self._wait_request(instance_id, request_id, wait_ms, engine_id, timeout_s)
        answer: List[bool] = []

        def done(err: Optional[PegaflowError]) -> None:
            on_done(None, err) if err is not None else on_done(answer[0] if answer else True, None)

        self._call_nowait(
            "WaitPrefetch", req, pb.WaitPrefetchRequest, pb.WaitPrefetchResponse, done, t,
            on_response=lambda r: answer.append(r.settled),
        )

    def _wait_request(
        self, instance_id: str, request_id: str, wait_ms: int, engine_id: Optional[str],
        timeout_s: Optional[float],
    ) -> Tuple[pb.WaitPrefetchRequest, float]:
        """The one WaitPrefetchRequest both `wait_prefetch` and its nowait form send, and its
        deadline: `timeout_s` (default the client's) plus the hold."""
        if not isinstance(wait_ms, int) or not 1 <= wait_ms <= MAX_PREFETCH_WAIT_MS:
            raise ValueError(f"wait_prefetch: wait_ms must be 1..{MAX_PREFETCH_WAIT_MS}, got {wait_ms!r}")
        req = pb.WaitPrefetchRequest(
            instance_id=instance_id, request_id=request_id, wait_ms=wait_ms, engine_id=self._engine(engine_id)
        )
        return req, (timeout_s if timeout_s is not None else self.config.rpc_timeout_s) + wait_ms / 1000.0

    def load(
        self,
        *,
        instance_id: str,
        tp_rank: int,
        pp_rank: int = 0,
        lease_id: bytes,
        block_ids: Sequence[int],
        load_state_shm: str,
        request_id: str = "",
        timeout_s: Optional[float] = None,
        whole: bool = False,
        engine_id: Optional[str] = None,
    ) -> pb.LoadResponse:
        """Consumes the lease for this rank and starts scattering into
        `block_ids`; returns at submit (progress is in the load state).
        `whole`: the engine reads the blocks only once all of them landed
        (async loading), so the server may copy over several lanes.
        It carries the client's `engine_id` (or the call's: see the class); the
        server refuses another engine's Load before it touches the lease (the
        load state is marked failed, as for any refused Load). "" is not checked."""
        req = self._load_request(
            instance_id, tp_rank, pp_rank, lease_id, block_ids, load_state_shm, request_id, whole, engine_id
        )
        return self._call("Load", req, pb.LoadResponse, timeout_s)

    def load_nowait(
        self,
        *,
        instance_id: str,
        tp_rank: int,
        pp_rank: int = 0,
        lease_id: bytes,
        block_ids: Sequence[int],
        load_state_shm: str,
        on_done: Callable[[Optional[PegaflowError]], None],
        request_id: str = "",
        timeout_s: Optional[float] = None,
        whole: bool = False,
        engine_id: Optional[str] = None,
    ) -> None:
        """`load` without waiting for the answer: the call is on its way when
        this returns, and `on_done(None | error)` runs once it is answered
        (on a gRPC or local-RPC reader thread, or here if that already happened). The deadline is
        the same as `load`'s; `engine_id` as for `load`."""
        req = self._load_request(
            instance_id, tp_rank, pp_rank, lease_id, block_ids, load_state_shm, request_id, whole, engine_id
        )
        self._call_nowait("Load", req, pb.LoadRequest, pb.LoadResponse, on_done, timeout_s)

    def _load_request(
        self,
        instance_id: str,
        tp_rank: int,
        pp_rank: int,
        lease_id: bytes,
        block_ids: Sequence[int],
        load_state_shm: str,
        request_id: str,
        whole: bool,
        engine_id: Optional[str],
    ) -> pb.LoadRequest:
        """The one LoadRequest both `load` and `load_nowait` send (`engine_id` None: the client's)."""
        return pb.LoadRequest(
            instance_id=instance_id,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            lease_id=bytes(lease_id),
            block_ids=list(block_ids),
            load_state_shm=load_state_shm,
            request_id=request_id,
            whole=whole,
            engine_id=self._engine(engine_id),
        )

    def release_nowait(
        self, lease_id: bytes, on_done: Callable[[Optional[PegaflowError]], None], timeout_s: Optional[float] = None
    ) -> None:
        """`release` without waiting for the answer, like `load_nowait`: a connector gives
        back a lease its rank will not load from (a refused or skipped Load) without
        holding up the engine's step."""
        self._call_nowait(
            "Release", pb.ReleaseRequest(lease_id=bytes(lease_id)), pb.ReleaseRequest, pb.ReleaseResponse,
            on_done, timeout_s,
        )

    def _call_nowait(
        self, method: str, req, req_cls, res_cls, on_done: Callable[[Optional[PegaflowError]], None],
        timeout_s: Optional[float], on_response: Optional[Callable[[Any], None]] = None,
    ) -> None:
        """Sends `req` and returns; `on_done(None | error)` runs on a reader thread once it is
        answered (or here if it could not be sent over gRPC), after `on_response(the answer)`
        when it is OK. The local socket when usable."""
        t = timeout_s if timeout_s is not None else self.config.rpc_timeout_s
        local = self._usable_local()
        if local is not None:

            def answered(status: int, body: bytes) -> None:
                if status == 0 and on_response is not None:
                    on_response(res_cls.FromString(body))
                on_done(None if status == 0 else _local_error(status, body.decode("utf-8", "replace"), method))

            try:
                local.call_nowait(METHOD_IDS[method], req.SerializeToString(), t, answered)
                return
            except LocalRpcAbsent:
                self._local_absent()
            except LocalRpcStatus as e:
                raise _local_error(e.code, e.details, method, not isinstance(e, LocalRpcNotSent)) from None
        stub = self._stub(method, req_cls, res_cls)
        try:
            fut = stub.future(req, timeout=t)
        except ValueError:
            if not self._closed:
                raise
            raise _closed_error(method) from None

        def done(f) -> None:
            if f.cancelled():  # the channel closed under it
                on_done(PegaflowError(grpc.StatusCode.CANCELLED, f"{method} cancelled", method))
                return
            e = f.exception()
            if e is None:
                if on_response is not None:
                    on_response(f.result())
                on_done(None)
            else:
                code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNKNOWN
                details = (e.details() if isinstance(e, grpc.RpcError) else str(e)) or ""
                if code == grpc.StatusCode.UNAVAILABLE:
                    self._reconnect_soon()
                on_done(_grpc_error(code, details, method))

        fut.add_done_callback(done)

    def release(self, lease_id: bytes, timeout_s: Optional[float] = None) -> None:
        """Gives a lease back before it is used up or expires."""
        self._call("Release", pb.ReleaseRequest(lease_id=bytes(lease_id)), pb.ReleaseResponse, timeout_s)

    def unregister_context(self, instance_id: str, timeout_s: Optional[float] = None) -> int:
        """Cleans the instance up; returns the number of leases released."""
        for rank in [k for k in list(self._tokens) if k[0] == instance_id]:
            self._tokens.pop(rank, None)  # its registrations end: their tokens stand for nothing
        r = self._call(
            "UnregisterContext",
            pb.UnregisterContextRequest(instance_id=instance_id),
            pb.UnregisterContextResponse,
            timeout_s,
        )
        return r.leases_released

    def open_session(
        self, instance_id: str, tp_rank: int = 0, pp_rank: int = 0, registration_token: Optional[str] = None
    ) -> Session:
        """Opens the liveness stream for one rank. It has no deadline (it lives
        as long as the registration); keepalive pings detect a dead peer.

        `registration_token` (default: the one this client was answered for the
        rank by RegisterContext): a registered rank takes a session only with its
        registration's token (else the stream ends FAILED_PRECONDITION naming the
        rank, and nothing is superseded), so open it after RegisterContext. Without
        one, only a rank not registered yet, and such a session stands for no
        registration: the rank's registration ends it (FAILED_PRECONDITION). A
        session that fails before the server took it (`Session.taken`) keeps the
        token for the retry."""
        stub = self._stub("Session", pb.SessionRequest, pb.SessionEvent, stream=True)
        rank = (instance_id, tp_rank, pp_rank)
        used = registration_token or self._tokens.get(rank)
        req = pb.SessionRequest(instance_id=instance_id, tp_rank=tp_rank, pp_rank=pp_rank)
        if used:
            req.registration_token = used

        def ended(s: Session, ev: Optional[pb.SessionEvent]) -> None:
            # The end of the session that stood for the rank ends its registration (the server
            # cleans the instance up): its token, and only its, is stale. Only a session that
            # presented a token and that the server took stood for one (the server adopts no
            # token-less session); a refusal of a presented token says it is stale too. One that
            # never reached the server (the connection was down) ended nothing: its token is kept
            # for the retry (before, it was dropped and the retry refused "no token"). A
            # superseded one's is not stale either.
            if not used or self._tokens.get(rank) != used:
                return
            if ev is not None and ev.kind == pb.SessionEvent.SUPERSEDED:
                return
            refused = s.error is not None and s.error.code in REFUSED_SESSION
            if s.taken or refused:
                self._tokens.pop(rank, None)

        try:
            return Session(stub(req), ended)
        except ValueError:
            if not self._closed:
                raise
            raise _closed_error("Session") from None

    def _usable_local(self) -> Optional[LocalRpc]:
        """The local RPC socket's client, unless there is none or it was found absent lately."""
        if self._local is None or self._local_retry_at > time.monotonic():
            return None
        return self._local

    def _local_absent(self) -> None:
        """No local RPC socket beside the unix: address (a server without one, or a server
        that is restarting): gRPC for a while, then the socket is tried again."""
        if self._local is not None:
            if self._local_retry_at == 0.0:
                log.info("no local RPC socket at %s; calls go over gRPC until it appears", self._local.path)
            self._local_retry_at = time.monotonic() + LOCAL_RPC_RETRY_S

    def _reconnect_soon(self) -> None:
        """A gRPC call failed UNAVAILABLE: the channel is down. grpcio moves a connection attempt
        on only while some thread polls the channel, and a call that fails at once (no
        wait_for_ready: pick_first stays in TRANSIENT_FAILURE until a connection is up) polls
        nothing. So after a server restart the channel found the server back only when gRPC's
        backup poller (every 5 s) happened to run during an attempt: re-registration, queries
        and saves failed on for 1.5-7.5 s whatever `reconnect_max_ms` said (and for good without
        that poller). One thread per down channel (`_drive_reconnect`) waits in a Health call
        that waits for the channel to be ready, which polls it, then ends."""
        with self._lock:
            ch = self._channel
            if self._closed or ch is None or self._pid != os.getpid():
                return
            if self._reconnect is not None and self._reconnect[0] is ch and self._reconnect[1].is_alive():
                return  # already driven
            # An event of its own (not one the client keeps): a fork never leaves the child one
            # whose lock a thread of the parent held.
            stop = threading.Event()
            t = threading.Thread(
                target=_drive_reconnect,
                args=(weakref.ref(self), ch, stop, self.config.rpc_timeout_s, self.config.reconnect_max_s),
                name="pegaflow-reconnect", daemon=True,
            )
            self._reconnect = (ch, t, stop)
            t.start()

    def close(self) -> None:
        """Closes the channel; later calls raise CANCELLED."""
        if self._local is not None:
            self._local.close()
        with self._lock:
            self._closed = True
            ch, self._channel = self._channel, None
            driving, self._reconnect = self._reconnect, None
            if ch is not None and self._pid == os.getpid():
                ch.close()  # cancels the reconnect's call too
        # Only this process's (after a fork, the parent's thread and event are not ours to touch).
        if driving is not None and driving[0] is ch and self._pid == os.getpid():
            driving[2].set()  # ends its pause between two calls
            driving[1].join(self.config.rpc_timeout_s)
