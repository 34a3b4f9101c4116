"""What a test's processes leave in /dev/shm: the files PegaFlow's Python side names after the
pid of the process that made them (`/dev/shm/pegaflow-kv-<pid>-...`, host KV regions;
`/dev/shm/pegaflow-ls-<pid>-...`, load states), the children the tests start, and cleaning up
after a child the test SIGKILLs (a killed process never unlinks its own files).

Other sessions use /dev/shm at the same time, so a file counts as ours only by its pid: this
pytest process's, or that of a child it started (subprocess.Popen, recorded by `track_children`)
that has exited, made no earlier than that child started.

Example:
    p = subprocess.Popen([...])
    ...
    kill_and_clean(p)        # SIGKILL, wait, unlink what p made
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

SHM = "/dev/shm"
_NAME = re.compile(r"^pegaflow-[a-z]+-(\d+)-")


def pid_of(name: str) -> Optional[int]:
    """The creator's pid in a PegaFlow shm name (`pegaflow-kv-<pid>-...`), else None."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def shm_files_of(pid: int, since: float = 0.0) -> List[str]:
    """Names in /dev/shm that process `pid` made (changed at or after `since`, a time.time())."""
    out = []
    for n in os.listdir(SHM):
        if pid_of(n) != pid:
            continue
        try:
            if os.stat(os.path.join(SHM, n)).st_ctime >= since:
                out.append(n)
        except FileNotFoundError:
            pass
    return sorted(out)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def remove_shm_of(pid: int, since: float = 0.0) -> List[str]:
    """Unlinks what the exited process `pid` made (only while no process has that pid: a pid
    in use again is another process's). Returns the names it removed."""
    if alive(pid):
        return []
    gone = []
    for n in shm_files_of(pid, since):
        try:
            os.unlink(os.path.join(SHM, n))
            gone.append(n)
        except FileNotFoundError:
            pass
    return gone


def kill_and_clean(proc: subprocess.Popen) -> List[str]:
    """SIGKILLs `proc` (if it still runs), reaps it, and unlinks the shm files it made: a
    killed process never unlinks its own. Returns the names removed."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    return remove_shm_of(proc.pid)


# ---- the children a test starts ------------------------------------------------------------


@dataclass
class Child:
    pid: int
    args: str
    started: float  # time.time(), a little before the exec
    proc: "weakref.ref[subprocess.Popen]"

    def exited(self) -> bool:
        p = self.proc()
        if p is not None:
            return p.poll() is not None
        return not alive(self.pid)


_children: List[Child] = []
_lock = threading.Lock()


def children(since: int = 0) -> List[Child]:
    """The children started so far, from index `since` (see `child_count`)."""
    with _lock:
        return list(_children[since:])


def child_count() -> int:
    with _lock:
        return len(_children)


def track_children() -> Callable[[], None]:
    """Records every subprocess.Popen this process starts (pid, command line, start time) from
    now on; returns what undoes it."""
    real_init = subprocess.Popen.__init__

    def init(self, *args, **kwargs):
        started = time.time() - 1.0  # ctime has a coarse clock: a margin, never a miss
        real_init(self, *args, **kwargs)
        argv = kwargs.get("args", args[0] if args else "")
        text = argv if isinstance(argv, str) else " ".join(map(str, argv))
        with _lock:
            _children.append(Child(self.pid, text[:300], started, weakref.ref(self)))

    subprocess.Popen.__init__ = init

    def undo() -> None:
        subprocess.Popen.__init__ = real_init

    return undo


def leftovers(kids: List[Child]) -> Dict[str, List[str]]:
    """For each exited child of `kids`, the shm files it left (removed here: they are proven
    ours); keyed by "pid N (command line)". Children still running are skipped."""
    out: Dict[str, List[str]] = {}
    for c in kids:
        if not c.exited():
            continue
        gone = remove_shm_of(c.pid, c.started)
        if gone:
            out[f"pid {c.pid} ({c.args})"] = gone
    return out


def assert_unlinked_at_exit(script: str, what: str, timeout_s: float) -> None:
    """Runs `script` in a fresh Python (this package importable): it makes two shm files, forks
    a child that exits first, prints both names and whether each exists, then dies on an
    unhandled exception. Asserts the child's exit left them (`what`: "states", "regions") and
    the parent's unlinked both."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=timeout_s)
    assert r.returncode == 1 and "the engine crashed" in r.stderr, r.stderr
    first, second, first_there, second_there = r.stdout.split()
    assert (first_there, second_there) == ("True", "True"), f"a forked child's exit unlinked its parent's {what}"
    left = [n for n in (first, second) if os.path.exists(SHM + n)]
    assert left == [], f"left in /dev/shm after the process ended: {left}"
