"""The local RPC socket: the hot calls (QueryPrefetch, WaitPrefetch, Load,
Release, Save, Health) to a server on the same host, in length-prefixed frames over the
Unix socket it serves beside `--uds PATH` (at `PATH.rpc`).

Why: QueryPrefetch and Load sit on a warm request's time to first token.
Through grpcio a call crosses its completion-queue thread, HTTP/2, the
server's relay and grpc-js (1-3.5 ms seen from an engine on a 0.35 ms
handler); here the caller's own thread writes one frame and reads one back.
The server answers with the gRPC service's own handlers, so status codes and
messages are the same as over gRPC.

Wire format (little-endian), one owner on each side: this file and
`lib/server/local_rpc.ts`:
    request:  u32 len | u32 call_id | u8 method | protobuf request
    response: u32 len | u32 call_id | u8 status | protobuf response (status 0)
                                                | UTF-8 details (else: a gRPC code)
`len` counts the bytes after itself. Answers may come out of order; they are
matched by call_id.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import struct
import threading
import time
import weakref
from typing import Callable, Dict, Optional, Tuple

__all__ = ["LOCAL_RPC_SUFFIX", "METHOD_IDS", "LocalRpc", "LocalRpcAbsent", "LocalRpcNotSent", "LocalRpcStatus"]

log = logging.getLogger("pegaflow.local_rpc")

LOCAL_RPC_SUFFIX = ".rpc"
METHOD_IDS: Dict[str, int] = {"QueryPrefetch": 1, "Load": 2, "Release": 3, "Save": 4, "Health": 5, "WaitPrefetch": 6}

_HEADER = struct.Struct("<IIB")  # len, call id, method / status
_LEN = struct.Struct("<I")
_UNAVAILABLE = 14
_DEADLINE_EXCEEDED = 4
_CANCELLED = 1
# A frame whose first bytes arrived and whose rest takes longer than this: the server is gone.
_FRAME_READ_TIMEOUT_S = 30.0


class LocalRpcAbsent(Exception):
    """No local RPC socket at the path (a server without `--uds`, or another host):
    the caller uses gRPC instead."""


class LocalRpcStatus(Exception):
    """A call answered with a non-OK status (a gRPC code number) or that failed locally
    (UNAVAILABLE: connection refused or broken; DEADLINE_EXCEEDED)."""

    def __init__(self, code: int, details: str):
        self.code = code
        self.details = details
        super().__init__(f"status {code}: {details}")


class LocalRpcNotSent(LocalRpcStatus):
    """A call that failed before any of its bytes left this process (no connection to the socket
    could be made, or the client was closed): the server never saw it."""


def _connect(path: str, timeout_s: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(max(timeout_s, 1e-3))
    try:
        s.connect(path)
    except FileNotFoundError:
        s.close()
        raise LocalRpcAbsent(path) from None
    except (ConnectionRefusedError, OSError) as e:
        s.close()
        raise LocalRpcNotSent(_UNAVAILABLE, f"local RPC socket {path}: {e}") from None
    return s


def _read_exact(
    s: socket.socket, view: memoryview, deadline: Optional[float] = None,
    look_up: Optional[Callable[[], float]] = None,
) -> None:
    """Fills `view`; with a `deadline` (time.monotonic()) each read gets only what is left of it,
    so a server trickling bytes cannot stretch a call past its deadline (socket.timeout).
    `look_up()`, when given (with a deadline), runs before each read and answers when it must
    run again: a read waits no longer than that, then goes on filling `view`."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("local RPC answer not complete by the deadline")
            if look_up is not None:
                left = min(left, max(look_up() - time.monotonic(), 1e-3))
            s.settimeout(left)
        try:
            n = s.recv_into(view[got:])
        except socket.timeout:
            if look_up is None:
                raise
            continue  # look_up is due; the deadline is checked above
        if n == 0:
            raise ConnectionResetError("the server closed the local RPC connection")
        got += n


def _read_frame(
    s: socket.socket, max_bytes: int, deadline: Optional[float] = None,
    look_up: Optional[Callable[[], float]] = None,
) -> Tuple[int, int, bytes]:
    """(call id, status, payload) of the next frame (whole by `deadline`, when given;
    `look_up` as for `_read_exact`)."""
    head = bytearray(_HEADER.size)
    _read_exact(s, memoryview(head), deadline, look_up)
    n, call_id, status = _HEADER.unpack(head)
    if n < 5 or n > max_bytes + 5:
        raise ConnectionResetError(f"local RPC answer of {n} bytes is outside 5..{max_bytes + 5}")
    body = bytearray(n - 5)
    if body:
        _read_exact(s, memoryview(body), deadline, look_up)
    return call_id, status, bytes(body)


def _deliver(on_done: Callable[[int, bytes], None], status: int, body: bytes, call_id: int) -> None:
    """Runs a nowait call's callback on the reader thread; what it raises is logged, never let
    out: it once ended the reader, and with it the connection and every other call in flight on
    it (failed UNAVAILABLE, their answers lost; a Load so failed holds its blocks as "answer
    lost")."""
    try:
        on_done(status, body)
    except Exception:  # noqa: BLE001 - the reader serves every call of the connection
        log.exception("local RPC call %d: its callback raised (status %d)", call_id, status)


class _ThreadSock:
    """A thread's connection for blocking calls. Only its thread's local state holds it, so it
    is closed when that thread ends (connections of threads long gone once stayed open, a
    descriptor and a server connection each, until the client was closed)."""

    __slots__ = ("sock", "__weakref__")

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def __del__(self) -> None:
        self.sock.close()  # a no-op when dropped or closed before


class _ThreadConn(threading.local):
    """A thread's own connection for blocking calls (and the process it was dialled in)."""

    conn: Optional[_ThreadSock] = None
    pid: int = -1


class LocalRpc:
    """Calls to the server's local RPC socket at `path`. Thread-safe: each thread makes its
    blocking calls on its own connection (a Save that waits for its copy never holds up the
    scheduler's QueryPrefetch); nowait calls share one more, whose answers a reader thread
    hands to their callbacks. A connection that breaks or times out is dropped and the next
    call dials again (a restarted server is found without any help).

    Example:
        rpc = LocalRpc("/run/pegaflow/grpc.sock.rpc", 64 << 20)
        body = rpc.call(METHOD_IDS["Health"], b"", timeout_s=5.0)
    """

    def __init__(self, path: str, max_message_bytes: int):
        self.path = path
        self.max_message_bytes = max_message_bytes
        self._lock = threading.Lock()  # the id counter, the connection list, close
        self._tls = _ThreadConn()
        # every live thread's, to close them all (a thread's own goes with it)
        self._socks: "weakref.WeakSet[_ThreadSock]" = weakref.WeakSet()
        self._pid = os.getpid()
        self._next_id = 0
        self._closed = False
        #: Calls sent over the socket (both kinds), for stats and tests.
        self.calls = 0
        # nowait calls: their connection, reader thread and pending callbacks
        self._alock = threading.Lock()
        self._asock: Optional[socket.socket] = None
        # call id -> (deadline, callback, the connection it was sent on)
        self._pending: Dict[int, Tuple[float, Callable[[int, bytes], None], socket.socket]] = {}
        self._reader: Optional[threading.Thread] = None
        # The reader sleeps until an answer comes or the earliest deadline of the calls in
        # flight (for good while none is: an idle engine's reader never wakes); a call due
        # before the reader's next wake pokes it through this socket.
        self._wake: Optional[socket.socket] = None
        self._wake_at = math.inf

    def _id(self) -> int:
        with self._lock:
            self._next_id = (self._next_id % 0xFFFFFFFF) + 1
            self.calls += 1
            return self._next_id

    def _forked(self) -> None:
        """After a fork the parent's sockets are shared: leave them to it, dial our own."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._socks = weakref.WeakSet()
            self._asock = None
            self._pending = {}
            self._reader = None
            self._wake = None
            self._wake_at = math.inf

    def _drop(self) -> None:
        c, self._tls.conn = self._tls.conn, None
        if c is not None:
            with self._lock:
                self._socks.discard(c)
            c.sock.close()

    def _conn(self, timeout_s: float) -> Tuple[socket.socket, bool]:
        """This thread's connection, dialled on first use (and again after a fork), and whether
        it was dialled just now."""
        t = self._tls
        if t.conn is None or t.pid != os.getpid():
            t.conn = _ThreadSock(_connect(self.path, timeout_s))
            t.pid = os.getpid()
            with self._lock:
                self._socks.add(t.conn)
            return t.conn.sock, True
        return t.conn.sock, False

    def call(self, method: int, payload: bytes, timeout_s: float) -> bytes:
        """One blocking call; returns the response bytes or raises LocalRpcStatus
        (LocalRpcNotSent: the server never saw it) / LocalRpcAbsent (nothing was sent)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                raise LocalRpcNotSent(_CANCELLED, "client is closed")
            self._forked()
        s, fresh = self._conn(timeout_s)
        call_id = self._id()
        frame = _HEADER.pack(5 + len(payload), call_id, method) + payload
        try:
            s.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                s.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                if fresh:
                    raise
                # The server closed this thread's idle connection (it restarted, or shut it):
                # no whole frame reached it, so the call goes once on a new one (the first
                # call after a restart once failed UNAVAILABLE on every thread).
                self._drop()
                try:
                    s, _ = self._conn(max(deadline - time.monotonic(), 1e-3))
                except LocalRpcAbsent:  # the server is down (its socket file went with it)
                    raise LocalRpcNotSent(
                        _UNAVAILABLE, f"local RPC connection to {self.path} closed, and the socket is gone"
                    ) from None
                s.settimeout(max(deadline - time.monotonic(), 1e-3))
                s.sendall(frame)
            while True:
                got, status, body = _read_frame(s, self.max_message_bytes, deadline)
                if got == call_id:
                    break
                if got == 0:  # the server refused our framing and closes
                    self._drop()
                    raise LocalRpcStatus(status, body.decode("utf-8", "replace"))
        except socket.timeout:
            self._drop()  # a half-read answer would desync the stream
            raise LocalRpcStatus(_DEADLINE_EXCEEDED, f"no answer within {timeout_s:.3f} s") from None
        except OSError as e:
            self._drop()
            raise LocalRpcStatus(_UNAVAILABLE, f"local RPC connection to {self.path} failed: {e}") from None
        if status != 0:
            raise LocalRpcStatus(status, body.decode("utf-8", "replace"))
        return body

    def call_nowait(
        self, method: int, payload: bytes, timeout_s: float, on_done: Callable[[int, bytes], None]
    ) -> None:
        """Sends the call and returns; `on_done(status, body)` runs on the reader thread
        once it is answered, or with DEADLINE_EXCEEDED / UNAVAILABLE. Raises
        LocalRpcAbsent or LocalRpcNotSent (nothing sent), or LocalRpcStatus if sending failed."""
        with self._alock:
            if self._closed:
                raise LocalRpcNotSent(_CANCELLED, "client is closed")
            self._forked()
            if self._asock is None:
                self._asock = _connect(self.path, timeout_s)
                wake_r, self._wake = socket.socketpair()
                self._wake.setblocking(False)
                self._wake_at = math.inf
                # The reader reads on a socket object of its own (the same connection): a
                # timeout it sets never applies to a send here, which has the call's own.
                self._reader = threading.Thread(
                    target=self._read_answers, args=(self._asock, self._asock.dup(), wake_r, self._wake),
                    name="pegaflow-local-rpc", daemon=True,
                )
                self._reader.start()
            s = self._asock
            call_id = self._id()
            due = time.monotonic() + timeout_s
            self._pending[call_id] = (due, on_done, s)
            try:
                # A server that stopped reading holds the send up to the call's deadline, no more.
                s.settimeout(max(due - time.monotonic(), 1e-3))
                s.sendall(_HEADER.pack(5 + len(payload), call_id, method) + payload)
            except OSError as e:  # socket.timeout included: part of a frame may have gone
                self._pending.pop(call_id, None)
                self._asock = None
                # Its reader may sleep with no deadline in sight: the shutdown wakes it, and it
                # closes the socket and fails the connection's other calls on its way out.
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                if isinstance(e, socket.timeout):
                    raise LocalRpcStatus(
                        _DEADLINE_EXCEEDED, f"local RPC {self.path}: not sent within {timeout_s:.3f} s"
                    ) from None
                raise LocalRpcStatus(_UNAVAILABLE, f"local RPC connection to {self.path} failed: {e}") from None
            if due < self._wake_at and self._wake is not None:
                self._wake_at = due
                try:
                    self._wake.send(b"\0")
                except OSError:
                    pass  # a full socket has a poke in it already; a closed one, no reader

    def _read_answers(
        self, s: socket.socket, rs: socket.socket, wake_r: socket.socket, wake_w: socket.socket
    ) -> None:
        """The nowait connection's reader: `s` is the connection as the senders hold it (their
        calls are filed under it), `rs` its own socket object on the same connection."""
        why = "closed"
        # poll, not select: select cannot watch a descriptor >= 1024 (FD_SETSIZE), which a
        # busy engine process reaches, and every nowait call then failed.
        poller = select.poll()
        poller.register(rs, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        try:
            while True:
                # Wait between frames until the earliest deadline in flight, or a poke; a
                # frame once begun is read whole (the server writes each frame at once), so a
                # deadline never cuts one in half.
                with self._alock:
                    self._wake_at = min((d for d, _, _ in self._pending.values()), default=math.inf)
                    due = self._wake_at
                timeout_ms = None if due == math.inf else max(0, math.ceil(1e3 * (due - time.monotonic())))
                ready = {fd: ev for fd, ev in poller.poll(timeout_ms)}
                if wake_r.fileno() in ready:
                    wake_r.recv(4096)
                if rs.fileno() not in ready:
                    self._expire(time.monotonic())
                    continue
                # The frame comes whole within _FRAME_READ_TIMEOUT_S, and calls in flight still
                # end at their deadlines while it trickles in (they once waited for it whole:
                # a server trickling an answer kept a 0.5 s call going, then answered it OK).
                call_id, status, body = _read_frame(
                    rs, self.max_message_bytes, time.monotonic() + _FRAME_READ_TIMEOUT_S,
                    lambda: self._expire(time.monotonic()),
                )
                with self._alock:
                    entry = self._pending.pop(call_id, None)
                if entry is not None:
                    _deliver(entry[1], status, body, call_id)
                self._expire(time.monotonic())
        except (OSError, ValueError) as e:  # ValueError: a socket closed under it
            why = str(e)
        finally:
            with self._alock:
                if self._asock is s:
                    self._asock = None
                if self._wake is wake_w:
                    self._wake = None
                # Only this connection's calls: after a failed send a new connection may
                # already carry calls of its own.
                pending = {k: v for k, v in self._pending.items() if v[2] is s}
                for k in pending:
                    del self._pending[k]
            s.close()
            rs.close()
            wake_r.close()
            wake_w.close()
            for k, (_, cb, _) in pending.items():
                _deliver(cb, _UNAVAILABLE, f"local RPC connection to {self.path} ended: {why}".encode(), k)

    def _expire(self, now: float) -> float:
        """Fails the nowait calls due by `now`; returns the earliest deadline still in flight."""
        with self._alock:
            late = [k for k, (d, _, _) in self._pending.items() if d <= now]
            cbs = [(k, self._pending.pop(k)[1]) for k in late]
            due = min((d for d, _, _ in self._pending.values()), default=math.inf)
        for k, cb in cbs:
            _deliver(cb, _DEADLINE_EXCEEDED, b"no answer before the deadline", k)
        return due

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._socks = list(self._socks), weakref.WeakSet()
        if self._pid == os.getpid():
            for c in conns:
                try:
                    c.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.sock.close()
        self._tls.conn = None
        with self._alock:
            s, self._asock = self._asock, None
        if s is not None and self._pid == os.getpid():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
