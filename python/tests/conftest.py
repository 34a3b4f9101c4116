"""Fixtures: one real host-backend server for the session (`server`), a
client on it, and unique ids so tests never share instances or names."""

from __future__ import annotations

import os
import re
import sys
import uuid

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
sys.path.insert(0, os.path.dirname(__file__))

from server_proc import ServerProc  # noqa: E402

from pegaflow.client import PegaflowClient  # noqa: E402


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
