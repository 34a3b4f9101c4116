"""A real PegaFlow server process for the tests: `main.ts` on the host
backend, started with `deno run`, its bound address read from the one JSON
line it prints on stdout, stopped (SIGTERM, then SIGKILL) at the end.
Server stderr goes to a temp file, shown when a start fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
from typing import List, Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
#: Start-up budget: type-check + pool + bind on a loaded 2-core machine.
START_TIMEOUT_S = 90.0


def server_has_flag(flag: str) -> bool:
    """True when this checkout's server parses `flag` (lib/server/config.ts)."""
    with open(os.path.join(ROOT, "lib", "server", "config.ts")) as f:
        return f'"{flag} ' in f.read()


def deno_binary() -> str:
    for p in (
        os.environ.get("PEGAFLOW_DENO", ""),
        os.path.join(ROOT, "tools", "deno", "node_modules", "deno", "deno"),
        os.path.join(ROOT, "deno"),
    ):
        if p and os.access(p, os.X_OK):
            return p
    raise RuntimeError(f"no deno binary: run `make deno` in {ROOT} or set PEGAFLOW_DENO")


class ServerProc:
    """One server child.

    Example:
        s = ServerProc.start()
        PegaflowClient(s.addr)...
        s.stop()
    """

    def __init__(self, proc: subprocess.Popen, addr: str, log_path: str, uds: Optional[str] = None):
        self.proc = proc
        self.addr = addr
        self.log_path = log_path
        #: The Unix socket path when started with --uds.
        self.uds = uds

    @classmethod
    def start(cls, addr: str = "127.0.0.1:0", extra: Optional[List[str]] = None) -> "ServerProc":
        env = dict(os.environ)
        env.setdefault("DENO_DIR", os.path.join(ROOT, ".cache", "deno"))
        env["NO_COLOR"] = "1"
        fd, log_path = tempfile.mkstemp(prefix="pegaflow-server-", suffix=".log")
        args = [
            deno_binary(), "run", "--allow-all", os.path.join(ROOT, "main.ts"),
            "--backend", "host", "--addr", addr, "--pool-size", "256mb", "--log-level", "info",
        ] + list(extra or [])
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=fd)
        os.close(fd)
        line: List[bytes] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not line or not line[0]:
            proc.kill()
            proc.wait()
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"server did not announce its address; stderr:\n{f.read()[-4000:]}")
        listening = json.loads(line[0])["listening"]
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        return cls(proc, listening["grpc"], log_path, listening.get("uds"))

    def logs(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        """SIGKILL: the server vanishes as in a crash."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.unlink(self.log_path)
        except FileNotFoundError:
            pass
