"""Fixtures: one real host-backend server for the session (`server`), a
client on it, and unique ids so tests never share instances or names.

Leak guard (tests/leaks.py): a test errors at teardown (autouse fixture) when it leaves PegaFlow
shm files (`/dev/shm/pegaflow-<kind>-<pid>-...`) of this process made during the test, or of a
child it started (subprocess.Popen) that has exited; the run fails at its end (sessionfinish)
when files of this process or of any child it started are left, or a child still runs. What
it finds is removed (matched by pid and creation time, so other sessions' files on the same
machine never match). A test that SIGKILLs a child cleans up after it (leaks.kill_and_clean)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import uuid

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
sys.path.insert(0, os.path.dirname(__file__))

from server_proc import ServerProc  # noqa: E402

from pegaflow.client import PegaflowClient  # noqa: E402

import leaks  # noqa: E402

#: How long a test's own files may take to go after its teardown (an unlink on a callback thread).
LATE_UNLINK_S = 2.0
_UNTRACK = pytest.StashKey()


def _own_left(since: float) -> list:
    """This process's shm files made at or after `since` and still there LATE_UNLINK_S later."""
    end = time.monotonic() + LATE_UNLINK_S
    while True:
        left = leaks.shm_files_of(os.getpid(), since)
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.05)


def _remove(names: list) -> None:
    for n in names:
        try:
            os.unlink(os.path.join(leaks.SHM, n))
        except FileNotFoundError:
            pass


def pytest_sessionstart(session):
    session.config.stash[_UNTRACK] = leaks.track_children()


def pytest_sessionfinish(session, exitstatus):
    """After every fixture's teardown (a session fixture's own teardown may run before the
    others'): nothing of this process or of its children may be left. Fails the run."""
    undo = session.config.stash.get(_UNTRACK, None)
    if undo is None:
        return
    undo()
    problems = []
    for c in leaks.children():
        if not c.exited():
            p = c.proc()
            if p is not None:
                p.kill()
                p.wait()
            elif _parent_of(c.pid) == os.getpid():
                os.kill(c.pid, signal.SIGKILL)
            problems.append(f"child still running at the end of the session (killed): pid {c.pid} ({c.args})")
    for who, names in leaks.leftovers(leaks.children()).items():
        problems.append(f"shm files left by child {who}: {names}")
    own = leaks.shm_files_of(os.getpid())
    _remove(own)
    if own:
        problems.append(f"shm files of this process left at the end of the session: {own}")
    if problems:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write("\n")
            tr.write_sep("=", "leaks at the end of the session (removed now)", red=True, bold=True)
            for line in problems:
                tr.write_line(line)
        else:
            sys.stderr.write("leaks at the end of the session (removed now):\n" + "\n".join(problems) + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


@pytest.fixture(autouse=True)
def _no_shm_left_by_the_test():
    """Torn down after the test's other function fixtures: the shm files this process made
    during the test, and those of the children the test started that have exited, are gone."""
    since = time.time() - 1.0  # ctime's coarse clock: a margin (the previous test was checked)
    first_child = leaks.child_count()
    yield
    problems = [f"shm files left by child {who}: {names}"
                for who, names in leaks.leftovers(leaks.children(first_child)).items()]
    own = _own_left(since)
    _remove(own)
    if own:
        problems.append(f"shm files of this process left by the test: {own}")
    if problems:
        pytest.fail("leaks (removed now):\n" + "\n".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def server():
    s = ServerProc.start()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    c = PegaflowClient(server.addr, rpc_timeout_ms=10_000)
    yield c
    c.close()


@pytest.fixture
def uid(request):
    """A unique id prefix for this test (instances, namespaces, request ids)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", request.node.name[:24]) + "-" + uuid.uuid4().hex[:8]


@pytest.fixture
def engine_factory(server, uid):
    """Connector test engines (tests/vllm_driver.py) on the session's server:
    `make(mode, **extra_config)`; closed at the end, and no shm file may be left."""
    from vllm_driver import Engine, vllm_config

    made = []

    def make(mode: str, **extra) -> "Engine":
        e = Engine(vllm_config(server.addr, f"{uid}-{len(made)}", "tiny-" + uid, mode, **extra))
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
    mine = [f for f in os.listdir("/dev/shm") if f.startswith("pegaflow-") and f"-{os.getpid()}-" in f]
    assert mine == [], f"shm files left behind: {mine}"
