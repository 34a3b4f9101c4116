"""pegaflow.devserver (the server the tests and benchmarks start): a start that fails leaves
nothing behind in the temp directory."""

from __future__ import annotations

import os
import tempfile

import pytest

from pegaflow.devserver import DevServer


def test_a_server_that_never_starts_leaves_no_log_file(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.setenv("PEGAFLOW_DENO", "/bin/false")  # exits at once, announcing nothing
    with pytest.raises(RuntimeError, match="did not announce its address"):
        DevServer.launch(["--backend", "host"], start_timeout_s=5)
    assert os.listdir(tmp_path) == []
