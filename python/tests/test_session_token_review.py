"""The client's registration tokens and its sessions, against a real host-backend server:
a session attempt that never reached the server (the connection was down) forgets no token,
so the retry presents the registration's token and stands for it; a session opened with no
token stands for no registration, so its end forgets no later registration's token. And the
protocol version: a client of the protocol before tokens is refused at RegisterContext."""

from __future__ import annotations

import os
import re
import socket
import threading
from typing import List, Optional

import grpc
import pytest

from pegaflow.client import PROTOCOL_VERSION, SESSION_TAKEN_HEADER, PegaflowClient
from pegaflow.errors import PegaflowError
from pegaflow.regions import export_kv_layers

from kv_helpers import make_kv
from waits import wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
#: How long the relay's accept loop waits before it checks for close().
ACCEPT_POLL_S = 0.05


class CuttableRelay:
    """A TCP relay to `target` ("host:port") that can be cut: while cut it closes every
    connection (the relayed ones too) and every new one at once, as a network blip between an
    engine and a server that stays up."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._lst = socket.socket()
        self._lst.bind(("127.0.0.1", 0))
        self._lst.listen(16)
        self._lst.settimeout(ACCEPT_POLL_S)
        self.addr = f"127.0.0.1:{self._lst.getsockname()[1]}"
        self._open: List[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._lst.accept()[0]
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            with self._lock:
                if self._cut:
                    conn.close()
                    continue
                up = socket.create_connection(self._target, timeout=10)
                up.settimeout(None)
                self._open += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass  # the other side went first (or the relay was cut)
        for s in (a, b):
            self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            if s in self._open:
                self._open.remove(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        s.close()

    def cut(self, on: bool) -> None:
        with self._lock:
            self._cut = on
            live = list(self._open) if on else []
        for s in live:
            self._drop(s)

    def close(self) -> None:
        self.cut(True)
        self._stop.set()
        self._lst.close()


def answers(c: PegaflowClient) -> bool:
    try:
        c.health(timeout_s=2.0)
        return True
    except PegaflowError:
        return False


def refusal(s) -> str:
    """Why a session the server did not take ended (its stream is over: this does not wait)."""
    s.next_event()
    return str(s.error)


def register_rank(c: PegaflowClient, kv, uid: str, client_version: Optional[str] = None):
    layers, _ = export_kv_layers(kv)
    kw = {} if client_version is None else {"client_version": client_version}
    return c.register_context(
        instance_id=uid, namespace="ns-" + uid, tp_rank=0, tp_size=1,
        layer_names=[l.name for l in layers], region_handles=[l.handle for l in layers],
        geometry=[l.geometry for l in layers], **kw,
    )


@pytest.fixture
def relay(server):
    r = CuttableRelay(server.addr)
    yield r
    r.close()


def assert_session_stands(c: PegaflowClient, uid: str) -> None:
    """A session opened now presents the registration's token (with none it is refused
    "carries no registration token"), the server takes it, and it stands for the registration:
    unregistering ends it CLEANED_UP."""
    again = c.open_session(uid)
    assert again.wait_taken(10.0) is True, refusal(again)
    c.unregister_context(uid)
    ev = again.next_event()
    assert ev is not None and ev.kind == ev.CLEANED_UP, again.error

def test_a_session_that_never_reached_the_server_keeps_the_token_and_the_retry_stands(relay, uid):
    c = PegaflowClient(relay.addr, rpc_timeout_ms=10_000, reconnect_max_ms=200)
    region, kv = make_kv(1, 8)
    try:
        token = register_rank(c, kv, uid).registration_token
        assert re.fullmatch(r"[0-9a-f]{32}", token)
        # The connection drops before the session opens: the attempt fails without reaching the
        # server, whose registration (inside its grace period) is untouched.
        relay.cut(True)
        lost = c.open_session(uid)
        assert lost.next_event() is None
        assert lost.error is not None and lost.error.code == grpc.StatusCode.UNAVAILABLE, lost.error
        relay.cut(False)
        wait_for(lambda: answers(c), "the connection back")
        # The retry presents the registration's token and stands for the registration.
        assert_session_stands(c, uid)
    finally:
        c.close()
        region.close()


def test_a_token_less_session_that_failed_keeps_a_later_registrations_token(relay, uid):
    c = PegaflowClient(relay.addr, rpc_timeout_ms=10_000, reconnect_max_ms=200)
    region, kv = make_kv(1, 8)
    try:
        relay.cut(True)
        early = c.open_session(uid)  # no registration yet: no token
        assert early.wait_taken(10.0) is False, "the early session reached the server"
        relay.cut(False)
        wait_for(lambda: answers(c), "the connection back")
        register_rank(c, kv, uid)
        # The early session's failure comes to light only now: it stood for no registration.
        assert early.next_event() is None and early.error.code == grpc.StatusCode.UNAVAILABLE, early.error
        assert_session_stands(c, uid)
    finally:
        c.close()
        region.close()


def test_a_client_of_the_protocol_before_tokens_is_refused_at_register_naming_both_versions(client, uid):
    region, kv = make_kv(1, 8)
    try:
        with pytest.raises(PegaflowError) as e:
            register_rank(client, kv, uid, client_version="pegaflow-1")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f'client version "pegaflow-1" does not match the server\'s "{PROTOCOL_VERSION}"' in e.value.details
        assert client.health().version == PROTOCOL_VERSION
    finally:
        region.close()


@pytest.mark.parametrize("name", ["PROTOCOL_VERSION", "SESSION_TAKEN_HEADER"])
def test_the_python_client_mirrors_the_servers_protocol_words(name):
    import pegaflow.client as pc

    with open(os.path.join(ROOT, "lib", "engine", "registration.ts")) as f:
        m = re.search(rf'export const {name} = "([^"]+)";', f.read())
    assert m is not None, f"{name} not found in lib/engine/registration.ts"
    assert getattr(pc, name) == m.group(1)
