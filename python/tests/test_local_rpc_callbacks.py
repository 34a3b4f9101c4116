"""The local RPC socket's nowait calls: a callback that raises is that call's affair alone. It
once ended the answer reader, and with it the connection and every other call in flight on it
(failed UNAVAILABLE although the server had answered them)."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from typing import Dict, List, Tuple

import pytest

from pegaflow.local_rpc import _HEADER, LocalRpc


@pytest.fixture
def answering_socket():
    """A local RPC socket that answers every call with status 0 and "answer of <call id>", the
    first two together once both arrived (so both answers wait in the buffer at once)."""
    d = tempfile.mkdtemp(prefix="pf-lrpc-cb-")
    path = os.path.join(d, "pf.sock.rpc")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(1)
    conns: List[socket.socket] = []

    def answer(call_id: int) -> bytes:
        body = f"answer of {call_id}".encode()
        return _HEADER.pack(5 + len(body), call_id, 0) + body

    def serve() -> None:
        c, _ = lst.accept()
        conns.append(c)
        first: List[int] = []
        while True:
            head = c.recv(_HEADER.size, socket.MSG_WAITALL)
            if len(head) < _HEADER.size:
                return
            n, call_id, _method = _HEADER.unpack(head)
            if n > 5:
                c.recv(n - 5, socket.MSG_WAITALL)
            if len(first) < 2:
                first.append(call_id)
                if len(first) == 2:
                    c.sendall(b"".join(answer(i) for i in first))
            else:
                c.sendall(answer(call_id))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    yield path
    for c in conns:
        c.close()
    lst.close()
    server.join(5)
    os.unlink(path)
    os.rmdir(d)


def test_a_nowait_callback_that_raises_leaves_the_other_calls_and_the_connection_alone(answering_socket):
    rpc = LocalRpc(answering_socket, 1 << 20)
    got: Dict[str, Tuple[int, bytes]] = {}
    done = threading.Event()

    def keep(name: str):
        def on_done(status: int, body: bytes) -> None:
            got[name] = (status, body)
            if len(got) == 3:
                done.set()

        return on_done

    def raises(status: int, body: bytes) -> None:
        got["first"] = (status, body)
        raise RuntimeError("a caller's bug")

    try:
        rpc.call_nowait(2, b"", 5.0, raises)
        second = rpc._next_id + 1
        rpc.call_nowait(2, b"", 5.0, keep("second"))
        third = rpc._next_id + 1
        rpc.call_nowait(2, b"", 5.0, keep("third"))  # the same connection, after the raise
        assert done.wait(10), f"not every callback ran: {got}"
        assert got["second"] == (0, f"answer of {second}".encode())
        assert got["third"] == (0, f"answer of {third}".encode())
    finally:
        rpc.close()
