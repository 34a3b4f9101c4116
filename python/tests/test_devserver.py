"""pegaflow.devserver (the server the tests and benchmarks start): a start that fails leaves
nothing behind in the temp directory."""

from __future__ import annotations

import json
import os
import tempfile
import time

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
    """The split bench/ttft.py reports per thread: the JS thread is there under its name, and over
    a window of work the threads' CPU adds up to the process's within a tick per thread. The
    window, as the benchmark's: threads that ended before it (the pool's pre-touch threads) are in
    the process's total but in no thread's."""
    s = DevServer.launch(
        ["--backend", "host", "--addr", "127.0.0.1:0", "--pool-size", "16mb", "--http-addr", "127.0.0.1:0"]
    )
    try:
        threads0, total0 = s.cpu_seconds_by_thread(), s.cpu_seconds()
        assert "deno" in threads0, threads0
        assert threads0["deno"] > 0, "the JS thread started the server: it used CPU"
        deadline = time.monotonic() + 10
        while s.cpu_seconds() - total0 < 0.2:  # metrics scrapes: work on the JS thread
            assert time.monotonic() < deadline, "200 scrapes of /metrics did not cost the server 0.2 s of CPU"
            for _ in range(20):
                s.metric("pegaflow_leases")
        threads1, total1 = s.cpu_seconds_by_thread(), s.cpu_seconds()
        grown = sum(threads1.values()) - sum(threads0.values())
        slack = (len(threads1) + 1) / os.sysconf("SC_CLK_TCK")
        assert abs(grown - (total1 - total0)) <= slack, (threads0, threads1, total0, total1)
        assert threads1["deno"] > threads0["deno"]
    finally:
        s.stop()
        s.remove_log()
