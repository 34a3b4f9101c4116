"""A real PegaFlow server process for the tests: `main.ts` on the host
backend with the tests' pool size and log level, started by
`pegaflow.devserver`; `stop()` also removes its log."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Iterator, List, Optional

from pegaflow.devserver import ROOT, DevServer

#: Start-up budget: type-check + pool + bind on a loaded 2-core machine.
START_TIMEOUT_S = 90.0


def free_addr() -> str:
    """A `127.0.0.1:PORT` nothing listens on right now (a server that is not there)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def server_has_flag(flag: str) -> bool:
    """True when this checkout's server parses `flag` (lib/server/config.ts)."""
    with open(os.path.join(ROOT, "lib", "server", "config.ts")) as f:
        return f'"{flag} ' in f.read()


class ServerProc(DevServer):
    """One server child.

    Example:
        s = ServerProc.start()
        PegaflowClient(s.addr)...
        s.stop()
    """

    @classmethod
    def start(cls, addr: str = "127.0.0.1:0", extra: Optional[List[str]] = None) -> "ServerProc":
        flags = ["--backend", "host", "--addr", addr, "--pool-size", "256mb", "--log-level", "info"]
        return cls.launch(flags + list(extra or []), START_TIMEOUT_S)

    def stop(self, grace_s: float = 10.0) -> None:
        super().stop(grace_s)
        self.remove_log()


@contextlib.contextmanager
def silent_local_rpc(base: str) -> Iterator[None]:
    """A local RPC socket at `base + ".rpc"` that accepts connections and never reads or answers
    (a wedged server), for deadline tests; everything is closed on exit."""
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(base + ".rpc")
    lst.listen(4)
    held: List[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        lst.settimeout(0.05)
        while not stop.is_set():
            try:
                held.append(lst.accept()[0])  # reads nothing, answers nothing
            except socket.timeout:
                pass

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield
    finally:
        stop.set()
        acceptor.join()  # before the close: accept() on a closed socket fails
        for h in held:
            h.close()
        lst.close()


def leases_become(server: DevServer, n: int, timeout_s: float = 10.0) -> None:
    """Waits until the server's `pegaflow_leases` gauge reads `n` (a server with --http-addr)."""
    deadline = time.monotonic() + timeout_s
    while server.metric("pegaflow_leases") != n:
        assert time.monotonic() < deadline, f"pegaflow_leases stays {server.metric('pegaflow_leases')}, expected {n}"
        time.sleep(0.02)
