"""pegaflow.devserver (the server the tests and benchmarks start): a start that fails leaves
nothing behind in the temp directory."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from pegaflow import devserver
from pegaflow.devserver import DevServer


def test_a_server_that_never_starts_leaves_no_log_file(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.setenv("PEGAFLOW_DENO", "/bin/false")  # exits at once, announcing nothing
    with pytest.raises(RuntimeError, match="did not announce its address"):
        DevServer.launch(["--backend", "host"], start_timeout_s=5)
    assert os.listdir(tmp_path) == []


def test_the_server_starts_with_the_serve_tasks_v8_flags():
    """As `deno task serve` runs it (lib/server/v8_flags.ts): the flags come from deno.json."""
    with open(os.path.join(devserver.ROOT, "deno.json")) as f:
        serve = json.load(f)["tasks"]["serve"]
    arg = devserver.serve_v8_flags()
    assert arg.startswith("--v8-flags=") and arg in serve.split()
    s = DevServer.launch(["--backend", "host", "--addr", "127.0.0.1:0", "--pool-size", "16mb"])
    try:
        assert arg in s.args
    finally:
        s.stop()
        s.remove_log()


def test_a_serve_task_without_v8_flags_is_named(monkeypatch, tmp_path):
    (tmp_path / "deno.json").write_text(json.dumps({"tasks": {"serve": "deno run -A main.ts"}}))
    monkeypatch.setattr(devserver, "ROOT", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"tasks.serve \('deno run -A main.ts'\) has no --v8-flags= argument"):
        devserver.serve_v8_flags()


def test_cpu_by_thread_names_the_js_thread_and_adds_up_to_the_process():
    """The split bench/ttft.py reports per thread: the JS thread is there under its name, and the
    threads' sum is the process's CPU within a tick per thread (none of them ended here)."""
    s = DevServer.launch(["--backend", "host", "--addr", "127.0.0.1:0", "--pool-size", "16mb"])
    try:
        by_thread = s.cpu_seconds_by_thread()
        total = s.cpu_seconds()
        assert "deno" in by_thread, by_thread
        assert by_thread["deno"] > 0, "the JS thread started the server: it used CPU"
        tick = 1 / os.sysconf("SC_CLK_TCK")
        assert abs(sum(by_thread.values()) - total) <= tick * (len(by_thread) + 1), (by_thread, total)
    finally:
        s.stop()
        s.remove_log()
