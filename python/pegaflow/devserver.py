"""Start a local PegaFlow server for tests and benchmarks.

Runs `main.ts` of this source checkout under Deno in a child process, reads the
address it bound from the one JSON line it prints on stdout (then keeps draining
stdout so the child never blocks on a full pipe), sends its stderr to a temp log
file, and stops it with SIGTERM, then SIGKILL. Only for a checkout: an installed
`pegaflow` package has no `main.ts` beside it.

Environment: PEGAFLOW_DENO (the deno binary; else
tools/deno/node_modules/deno/deno or ./deno), DENO_DIR (default .cache/deno of
the checkout), PEGAFLOW_DENO_CACHED_ONLY=1 (adds --cached-only: no network).

Example:
    s = DevServer.launch(["--backend", "host", "--addr", "127.0.0.1:0", "--pool-size", "256mb"])
    PegaflowClient(s.addr)...
    s.stop()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from typing import Dict, List, Optional

#: The checkout this module sits in (python/pegaflow/devserver.py).
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def deno_binary() -> str:
    """The deno that runs the server: $PEGAFLOW_DENO, else the checkout's own."""
    for p in (
        os.environ.get("PEGAFLOW_DENO", ""),
        os.path.join(ROOT, "tools", "deno", "node_modules", "deno", "deno"),
        os.path.join(ROOT, "deno"),
    ):
        if p and os.access(p, os.X_OK):
            return p
    raise RuntimeError(f"no deno binary: set PEGAFLOW_DENO or run `make deno` in {ROOT}")


def serve_v8_flags() -> str:
    """The `--v8-flags=...` argument of deno.json's `serve` task: the server runs here as
    `deno task serve` runs it (lib/server/v8_flags.ts says why it has V8 flags)."""
    path = os.path.join(ROOT, "deno.json")
    with open(path) as f:
        serve = json.load(f).get("tasks", {}).get("serve", "")
    for arg in serve.split():
        if arg.startswith("--v8-flags="):
            return arg
    raise RuntimeError(f"{path}: tasks.serve ({serve!r}) has no --v8-flags= argument")


class DevServer:
    """One server child, started by :meth:`launch`."""

    def __init__(self, proc: subprocess.Popen, args: List[str], listening: dict, log_path: str):
        self.proc = proc
        #: The command line it runs.
        self.args = args
        #: The gRPC address it bound (host:port).
        self.addr: str = listening["grpc"]
        #: The Unix socket path when started with --uds, else None.
        self.uds: Optional[str] = listening.get("uds")
        #: The HTTP address (host:port: metrics, admin) when started with --http-addr, else None.
        self.http: Optional[str] = listening.get("http")
        #: Where its stderr goes.
        self.log_path = log_path

    @classmethod
    def launch(
        cls, flags: List[str], start_timeout_s: float = 90.0, log_prefix: str = "pegaflow-server-"
    ) -> "DevServer":
        """Runs `main.ts flags...` and waits up to `start_timeout_s` for its address.

        Raises RuntimeError naming the command line, with the tail of the server's
        stderr, when it does not announce its address in time (the child is killed).
        """
        args = [deno_binary(), "run", "--allow-all", serve_v8_flags()]
        if os.environ.get("PEGAFLOW_DENO_CACHED_ONLY") == "1":
            args.append("--cached-only")
        args += [os.path.join(ROOT, "main.ts")] + list(flags)
        env = dict(os.environ)
        env.setdefault("DENO_DIR", os.path.join(ROOT, ".cache", "deno"))
        env["NO_COLOR"] = "1"
        fd, log_path = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=fd)
        os.close(fd)
        line: List[bytes] = []
        deadline = time.monotonic() + start_timeout_s
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout_s)
        if not line or not line[0]:
            proc.kill()
            proc.wait()
            with open(log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            os.unlink(log_path)  # its tail is in the error; nobody else has its name
            raise RuntimeError(
                f"server did not announce its address within {start_timeout_s:g} s "
                f"({' '.join(args)}); stderr:\n{tail}"
            )
        listening = json.loads(line[0])["listening"]
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        server = cls(proc, args, listening, log_path)
        server._wait_healthy(deadline)
        return server

    def _wait_healthy(self, deadline: float) -> None:
        """The address line means the sockets are bound; on a loaded machine a
        first connection can still fail its handshake (UNAVAILABLE). Ask Health
        until it answers, within the start-up deadline, so that callers' first
        RPC meets a server that is serving."""
        from .client import PegaflowClient  # lazy: only a started server needs grpc here
        from .errors import PegaflowError

        client = PegaflowClient(self.addr, rpc_timeout_ms=2000)
        try:
            while True:
                try:
                    client.health()
                    return
                except PegaflowError as e:
                    if time.monotonic() >= deadline:
                        self.kill()
                        tail = self.logs()[-4000:]
                        self.remove_log()  # the caller never gets the server, nor its log's name
                        raise RuntimeError(
                            f"server at {self.addr} announced its address but its Health "
                            f"never answered ({e}); stderr:\n{tail}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def metric(self, name: str, timeout_s: float = 10.0) -> float:
        """A counter or gauge without labels from the server's /metrics (0 when absent);
        needs a server started with --http-addr."""
        if not self.http:
            raise RuntimeError("metric(): the server was started without --http-addr")
        with urllib.request.urlopen(f"http://{self.http}/metrics", timeout=timeout_s) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def cpu_seconds(self) -> float:
        """User plus system CPU seconds the server process has used so far (/proc/PID/stat)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def cpu_seconds_by_thread(self) -> Dict[str, float]:
        """User plus system CPU seconds per thread name (/proc/PID/task/*/stat), threads of one
        name summed (the server names its own: `deno` for the JS thread, `pf-cu-done`, the copy
        lanes...). A thread that ended is no longer counted, so the sum may be below
        `cpu_seconds()`."""
        base = f"/proc/{self.proc.pid}/task"
        tick = os.sysconf("SC_CLK_TCK")
        out: Dict[str, float] = {}
        for tid in os.listdir(base):
            try:
                with open(f"{base}/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # the thread ended between the listing and the read
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        return out

    def post(self, path: str, timeout_s: float = 30.0) -> int:
        """POSTs to the server's HTTP admin `path` (e.g. /cache/memory/cleanup); its status."""
        if not self.http:
            raise RuntimeError("post(): the server was started without --http-addr")
        req = urllib.request.Request(f"http://{self.http}{path}", method="POST")
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            return r.status

    def logs(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        """SIGKILL: the server vanishes as in a crash."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`. The log file stays (see :meth:`remove_log`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove_log(self) -> None:
        try:
            os.unlink(self.log_path)
        except FileNotFoundError:
            pass
