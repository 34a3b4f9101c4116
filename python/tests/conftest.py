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
