"""GPU-side layer waits (pegaflow/gpu_wait.py), on a CUDA device: a wait enqueued on a stream
holds the kernels behind it until the load state's `layers_ready` passes the layer, a released
state lets every wait through, a retired state is handed back only after the stream passed its
waits; and the tiny engine on the GPU against a cuda-backend server loads layer-wise through
GPU waits, byte-equal, with the cold request's tokens."""

from __future__ import annotations

import random
import struct
import time

import pytest
import torch

from pegaflow.devserver import DevServer
from pegaflow.gpu_wait import GpuWaits
from pegaflow.load_state import LoadState
from pegaflow.minivllm import EngineConfig, LLMEngine

from minivllm_runs import cold_then_warm, connector_config
from tiny_model import TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

LAYERS_READY_OFF = 16


def _land(st: LoadState, layers: int) -> None:
    """What the server's completion thread does when `layers` layers have landed."""
    struct.pack_into("<I", st._mm, LAYERS_READY_OFF, layers)


def _done_within(ev: torch.cuda.Event, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ev.query():
            return True
        time.sleep(0.001)
    return False


@pytest.fixture
def waits():
    gw = GpuWaits.open()
    assert gw is not None, "the driver has no stream memory operations"
    # Every kernel the tests launch behind a wait is loaded first: CUDA's lazy module loading
    # synchronizes the context at a kernel's first launch, which a pending wait would block.
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    yield gw
    gw.close()


def test_a_stream_wait_holds_the_kernels_behind_it_until_the_layer_lands(waits):
    st = LoadState.create()
    x = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    try:
        assert waits.arm(st) and st.gpu_word is not None
        with torch.cuda.stream(s):
            assert waits.wait(st, 1)  # layers_ready > 1
            x.add_(1)
            ev = torch.cuda.Event()
            ev.record()
        _land(st, 1)
        time.sleep(0.05)
        assert not ev.query(), "the kernel ran before layer 1 landed"
        _land(st, 2)
        assert _done_within(ev, 5.0), "the wait did not pass after layer 1 landed"
        assert x.item() == 1.0
    finally:
        st.release_waiters()
        s.synchronize()
        st.close()
    assert st.gpu_word is None


def test_the_watchdog_releases_a_load_that_never_lands_at_its_deadline(waits):
    st = LoadState.create()
    x = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    try:
        assert waits.arm(st)
        waits.guard(st, time.monotonic() + 0.3)
        with torch.cuda.stream(s):
            assert waits.wait(st, 0)
            x.add_(1)
            ev = torch.cuda.Event()
            ev.record()
        time.sleep(0.1)
        assert not ev.query(), "the kernel ran before the load landed or its deadline passed"
        # Nobody lands it and the test's thread does nothing: the watchdog lets the stream go.
        assert _done_within(ev, 5.0), "the stream still waits after the deadline"
        assert x.item() == 1.0
        assert st.state == 0, "the watchdog must not touch the state word (the server's)"
    finally:
        st.release_waiters()
        s.synchronize()
        st.close()


def test_release_lets_every_wait_through_and_retired_states_wait_for_the_stream(waits):
    st = LoadState.create()
    s = torch.cuda.Stream()
    handed_back = []
    try:
        assert waits.arm(st)
        with torch.cuda.stream(s):
            for layer in range(4):
                assert waits.wait(st, layer)
            waits.retire(st, handed_back.append)
            ev = torch.cuda.Event()
            ev.record()
        time.sleep(0.02)
        waits.reap()
        assert handed_back == [], "a state was handed back while the stream still waited on it"
        assert waits.retired == 1
        st.release_waiters()  # the deadline passed: nothing may keep the stream waiting
        assert _done_within(ev, 5.0)
        waits.reap()
        assert handed_back == [st] and waits.retired == 0
        assert st.state == 0, "release must not touch the state word (the server's)"
    finally:
        st.release_waiters()
        s.synchronize()
        st.close()


def test_a_scheduler_issued_load_failing_mid_forward_lets_the_stream_go(waits):
    """The scheduler's Load breaks (its answer: a deadline, a lost connection) after the worker
    queued the stream's wait for layer 0: the scheduler marks the state failed without raising
    `layers_ready` (the server writes all ones for a rank it does not know, which the stream's
    compare reads as -1). The worker sees the failure at layer 1; the stream's wait must pass
    then, not at the load's deadline, nor never (the recycled state is no longer guarded)."""
    from pegaflow.client import PegaflowClient
    from pegaflow.connector.plan import LoadIntent, StepPlan
    from pegaflow.connector.worker_core import WorkerCore

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    client = PegaflowClient("127.0.0.1:1", rpc_timeout_ms=200)  # no server: registered later
    w = WorkerCore(client, instance_id="gw-fail", namespace="ns-gw-fail", load_timeout_s=60.0)
    st = LoadState.create()  # the scheduler's state of this rank's Load
    s = torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    try:
        w.register_kv_caches({n: torch.zeros((2, 8, 4, 2, 8), dtype=torch.float16, device="cuda") for n in layers})
        w.bind(StepPlan(loads=[LoadIntent("r", b"\x01" * 16, [1, 2], states={(0, 0): st.name})]))
        w.start_load()
        assert w.stats_snapshot()["gpu_wait_loads"] == 1
        with torch.cuda.stream(s):
            w.wait_for_layer_load(layers[0])  # pending: the stream waits for layer 0
            st.mark_failed()  # the Load's answer was an error
            w.wait_for_layer_load(layers[1])  # the host sees the failure
            x.add_(1)
            ev = torch.cuda.Event()
            ev.record()
        w.wait_for_save()
        w.unbind()
        assert w.take_load_errors() == {1, 2}
        assert _done_within(ev, 5.0), "the stream still waits on the state of a load that failed"
        assert x.item() == 1.0
    finally:
        st.release_waiters()  # never leave the device waiting, whatever failed above
        s.synchronize()
        w.close(unregister=False)
        client.close()
        st.close()


def test_a_state_closed_behind_queued_work_waits_for_an_idle_stream_not_the_host(waits):
    """cuMemHostUnregister waits for the device to drain (64 ms behind queued work on an H200).
    A load state the worker closes for good (a scheduler-issued load's, attached) is therefore
    closed at a later step's start with the stream idle: closed at the end of the forward, it
    held the warm step's host until the last layer and all queued behind it had run."""
    from pegaflow.client import PegaflowClient
    from pegaflow.connector.plan import LoadIntent, StepPlan
    from pegaflow.connector.worker_core import WorkerCore

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    client = PegaflowClient("127.0.0.1:1", rpc_timeout_ms=200)  # no server: registered later
    w = WorkerCore(client, instance_id="gw-close", namespace="ns-gw-close", load_timeout_s=60.0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    a @ a  # its kernel loaded before any wait is queued
    states = [LoadState.create() for _ in range(2)]  # the scheduler's, one per step
    try:
        w.register_kv_caches({n: torch.zeros((2, 8, 4, 2, 8), dtype=torch.float16, device="cuda") for n in layers})
        # A scheduler's Load lands in this rank's memory only while the rank is registered (the
        # worker fails it otherwise): stand in for a server that took the registration.
        w.registration._up.set()
        for i, st in enumerate(states):
            w.bind(StepPlan(loads=[LoadIntent(f"r{i}", b"\x01" * 16, [1, 2], states={(0, 0): st.name})]))
            w.start_load()
            _land(st, len(layers))  # the server: every layer landed, the load done
            struct.pack_into("<i", st._mm, LAYERS_READY_OFF + 4, 1)
            for name in layers:
                w.wait_for_layer_load(name)
            for _ in range(200):  # the rest of the step's forward, still queued (tens of ms)
                a @ a
            queued = torch.cuda.Event()
            queued.record()
            w.wait_for_save()  # step 1: the GPU is past step 0's waits, its state is closed
            assert not queued.query(), f"step {i}: the host waited for the queued work to run"
            w.unbind()
            torch.cuda.synchronize()
        assert w.stats_snapshot()["gpu_wait_loads"] == 2
        assert waits is not None and w._gpu is not None and w._gpu.closing == 1  # step 0's state
        w.bind(StepPlan())  # the next step's start, the stream idle: it is closed now
        assert w._gpu.closing == 0
        w.unbind()
    finally:
        for st in states:
            st.release_waiters()
        torch.cuda.synchronize()
        w.close(unregister=False)
        client.close()
        for st in states:
            st.close()


@pytest.fixture(scope="module")
def cuda_server():
    srv = DevServer.launch(
        ["--backend", "cuda", "--addr", "127.0.0.1:0", "--pool-size", "512mb", "--log-level", "info"],
        120.0,
        "pegaflow-gpu-wait-",
    )
    yield srv
    srv.stop(10.0)


@pytest.mark.parametrize("issuer,staging", [("worker", 0), ("query", 32)])
def test_the_engine_on_the_gpu_loads_layer_wise_through_gpu_waits(cuda_server, issuer, staging):
    uid = f"gw-{issuer}-{random.randrange(1 << 30)}"
    ktc = connector_config(
        uid, cuda_server.addr, f"ns-{uid}", mode="layerwise", load_issuer=issuer, staging_blocks=staging or None
    )
    eng = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64, device="cuda", kv_transfer_config=ktc))
    rng = random.Random(uid)
    prompt = [rng.randrange(TINY.vocab_size) for _ in range(150)]
    try:
        cold_then_warm(eng, prompt, tol=1e-3)
        stats = eng.worker_connector.pegaflow_stats()
        assert stats.get("gpu_wait_loads", 0) == 1, stats
        assert stats.get("load_failures", 0) == 0, stats
        eng.drain(timeout_s=60)
    finally:
        eng.shutdown()
