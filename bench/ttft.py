#!/usr/bin/env python3
"""Time to first token with PegaFlow under a vLLM-shaped engine (`pegaflow.minivllm`).

The server (Deno, `main.ts`) runs in its own process; this process runs the engine with
`PegaflowConnector` driven in vLLM's call order; the KV cache is shared by CUDA IPC (host
backend: shared-memory files). TTFT = `add_request` → first sampled token on the CPU.

Measured per prompt length (after warm-up, `--runs` each, p50/p99):
  cold            a fresh prompt (nothing cached anywhere)
  warm            the same prompt after reset_prefix_cache(): the hit must come from PegaFlow;
                  layer-wise mode (layer i computes while layers > i load)
  warm_ltc        warm, but every layer's load awaited before the forward (no overlap)
  warm_async      warm in the connector's async mode (WAITING_FOR_REMOTE_KVS between steps)
  gpu_hit         the engine's own GPU prefix-cache hit (no load at all): the floor, and the
                  warm step's own compute time
  link            the loaded bytes over the H2D rate of one large pinned copy, timed here
  transformers    LlamaForCausalLM (random init, same shape, bf16, sdpa) forward of the prompt
Decode throughput with PegaFlow on at 0 % hits vs off (`--decode-requests` × `--decode-tokens`).
Correctness in the same run: loaded blocks byte-equal to the cold ones (stashed before the
reset), same first token, logits close. Targets are printed pass/fail and written to JSON.

  python3 bench/ttft.py                                   # GPU: cuda backend, Llama-3.1-8B shape
  python3 bench/ttft.py --backend host --config tiny      # CPU smoke (CI machine)

Environment: PEGAFLOW_DENO (deno binary; else tools/deno/node_modules/deno/deno or ./deno),
DENO_DIR, PEGAFLOW_DENO_CACHED_ONLY=1 (adds --cached-only: no network needed),
PEGAFLOW_TTFT_SERVER_LOG (the server's --log-level, default warn; debug logs each RPC's
handler/respond ms and each load's phases) and PEGAFLOW_TTFT_SERVER_LOG_COPY (a file that
receives the server's log at the end).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

from pegaflow import native  # noqa: E402
from pegaflow.client import PegaflowClient  # noqa: E402
from pegaflow.connector.vllm_api import KVTransferConfig  # noqa: E402
from pegaflow.devserver import DevServer  # noqa: E402
from pegaflow.minivllm import CONFIGS, EngineConfig, LLMEngine, LlamaModel  # noqa: E402
from pegaflow.minivllm.model_runner import shm_kv_cache_allocator  # noqa: E402

CONNECTOR_MODULE = "pegaflow.connector.vllm"
CONNECTOR_CLASS = "PegaflowConnector"
SERVER_START_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------- server


def start_server(
    backend: str, pool_size: str, transfer_path: str | None, uds_dir: str | None
) -> tuple[DevServer, str]:
    """`main.ts` in a child process (pegaflow.devserver); returns it and the address to dial."""
    flags = [
        "--backend", backend,
        "--addr", "127.0.0.1:0",
        "--pool-size", pool_size,
        "--log-level", os.environ.get("PEGAFLOW_TTFT_SERVER_LOG", "warn"),
    ]  # fmt: skip
    if transfer_path:
        flags += ["--transfer-path", transfer_path]
    # An engine beside the server reaches it over a Unix socket (--uds):
    # the local control plane, with no TCP stack between the two.
    if uds_dir:
        flags += ["--uds", os.path.join(uds_dir, "pf.sock")]
    try:
        server = DevServer.launch(flags, SERVER_START_TIMEOUT_S, "pegaflow-ttft-server-")
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    return server, f"unix:{server.uds}" if uds_dir else server.addr


# ---------------------------------------------------------------------------- helpers


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


#: A decode step's host phases, in order (minivllm's phase clock): each is the time from the
#: previous mark to its own; "sched" starts at the step.
STEP_PHASES = (
    ("sched", "schedule_start", "scheduled"),  # scheduler + the connector's build_connector_meta
    ("to_runner", "scheduled", "runner_start"),  # the metadata's pickle round trip
    ("prepare", "runner_start", "prepared"),
    ("pre_fwd", "prepared", "pre_forward_done"),  # bind + start_load_kv
    ("launch", "pre_forward_done", "forward_launched"),  # the forward's launches + per-layer hooks
    ("post_fwd", "forward_launched", "post_forward_done"),  # wait_for_save + get_finished
    ("sample", "post_forward_done", "sampled"),  # LM head + argmax to the host (waits on the GPU)
    ("update", "sampled", "updated"),  # the output's pickle + update_from_output
)


#: One decode run: (decode-phase tokens/s, end-to-end tokens/s, each step's host ms, each step's
#: host phases in ms by STEP_PHASES name).
DecodeRun = tuple[float, float, list[float], dict[str, list[float]]]


# Wall clock minus perf_counter: turns a Request's arrival_time into epoch seconds (server log).
EPOCH_MINUS_PERF_S = time.time() - time.perf_counter()


def copy_breakdown(logs: str, runs: list[tuple[str, float, float]]) -> dict[str, Any] | None:
    """Where each warm run's time went around its copy, from the server's debug "load done"
    lines (wall-clock submit and completion, by request id): ms from arrival to the copy's
    submit and to its completion, the copy itself, and from its completion to the first token.
    None when the log has no such lines (the server logged above debug)."""
    loads: dict[str, dict] = {}
    for line in logs.splitlines():
        if '"load done"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("msg") == "load done" and "submitted_epoch_ms" in rec and rec.get("request"):
            loads[rec["request"]] = rec
    rows = [(loads[rid], arr, ttft) for rid, arr, ttft in runs if rid in loads]
    if not rows:
        return None
    sub = [r["submitted_epoch_ms"] - arr for r, arr, _ in rows]
    done = [r["done_epoch_ms"] - arr for r, arr, _ in rows]
    return {
        "runs": len(rows),
        "submitted_ms": summary(sub),
        "done_ms": summary(done),
        "copy_ms": summary([d - s for s, d in zip(sub, done)]),
        "after_copy_ms": summary([ttft - d for d, (_, _, ttft) in zip(done, rows)]),
    }


def summary(xs: list[float]) -> dict[str, Any]:
    """Percentiles, and every run in order (a tail is read against its neighbours)."""
    return {
        "p50": pct(xs, 50), "p99": pct(xs, 99), "mean": statistics.fmean(xs), "n": len(xs),
        "runs_ms": [round(x, 3) for x in xs],
    }


# Student's t, two-sided 95 %, by degrees of freedom (1..30; beyond, the normal's 1.96 is within 2 %).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)  # fmt: skip


def mean_ci95(xs: list[float]) -> tuple[float, float]:
    """The 95 % confidence interval of the mean of `xs` (independent rounds; Student's t)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, m
    half = (_T975[len(xs) - 2] if len(xs) - 1 <= len(_T975) else 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m - half, m + half


class Prompts:
    def __init__(self, vocab: int, seed: int = 1234) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def first_token(eng: LLMEngine, prompt: list[int], timeout_s: float = 120.0):
    """Run one request to its first token; (ttft seconds, request, logits, block table)."""
    # No collector pause inside a timed request (vLLM freezes its GC after start-up for the same reason).
    gc.collect()
    gc.disable()
    try:
        req = eng.add_request(prompt, max_tokens=1)
        deadline = time.monotonic() + timeout_s
        while not req.is_finished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{req.request_id}: no first token after {timeout_s} s")
            eng.step()
    finally:
        gc.enable()
    out = eng.last_runner_output
    return (
        req.first_token_time - req.arrival_time,
        req,
        out.logits[req.request_id],
        list(eng.last_block_tables[req.request_id]),
        out.timeline,
    )


class ControlPlaneClock:
    """Marks when this process sent a QueryPrefetch, got its answer, and sent a Load (the
    control plane a warm request waits on before its copy starts), and, after the forward, when
    the worker's end-of-step calls ran (the host side of the tail between the last layer landing
    and the first token), by wrapping the client's and the worker's methods while a timed
    request runs. perf_counter times, like the engine's phases: the first query and Load of the
    timed request, the last of the other calls (the steps drained before it also call them)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        # The same marks in wall-clock ms, to line up with the server's debug log
        # ("local rpc" lines carry in_epoch_ms / out_epoch_ms).
        self.epoch_ms: dict[str, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str, before: str | None, after: str | None, first: bool = False) -> None:
        fn = getattr(owner, name)
        marks, epoch = self.marks, self.epoch_ms

        def mark(key: str) -> None:
            if not first or key not in marks:
                marks[key], epoch[key] = time.perf_counter(), time.time() * 1e3

        def timed(*a: Any, **kw: Any) -> Any:
            if before:
                mark(before)
            try:
                return fn(*a, **kw)
            finally:
                if after:
                    mark(after)

        self._saved.append((owner, name, fn))
        setattr(owner, name, timed)

    def __enter__(self) -> "ControlPlaneClock":
        from pegaflow.connector.worker_core import WorkerCore
        from pegaflow.load_state import LoadState

        self._wrap(PegaflowClient, "query_prefetch", "query_sent", "query_answered", first=True)
        self._wrap(PegaflowClient, "load_nowait", "load_sent", None, first=True)
        self._wrap(WorkerCore, "wait_for_save", "wait_for_save", "wait_for_save_done")
        self._wrap(LoadState, "wait_all", None, "load_seen_done")
        self._wrap(WorkerCore, "get_finished", None, "get_finished_done")
        self._wrap(WorkerCore, "_save", "save_thread_woke", None)
        self._wrap(PegaflowClient, "save", "save_sent", "save_answered")
        # Inside wait_for_save after the load is seen done, and the GPU wait's page registration.
        from pegaflow.gpu_wait import GpuWaits

        self._wrap(WorkerCore, "_finish_step_loads", None, "step_loads_finished")
        self._wrap(GpuWaits, "reap", "reap", "reap_done")
        self._wrap(GpuWaits, "arm", "arm", "arm_done")
        self._wrap(LoadState, "close", "state_close", "state_close_done")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


def phases_ms(eng: LLMEngine, req, extra: dict[str, float] | None = None) -> dict[str, float]:
    """The last step's phases (recorded with the timeline), plus `extra` marks, in ms since
    the request arrived."""
    ph = dict(eng.last_runner_output.phases or {})
    ph.update(extra or {})
    return {k: (v - req.arrival_time) * 1e3 for k, v in sorted(ph.items(), key=lambda kv: kv[1])}


def h2d_rate(nbytes: int, dev: torch.device) -> float:
    """Bytes/s of one large host→device copy from pinned memory (the link's practical rate)."""
    nbytes = max(nbytes, 64 << 20)
    if dev.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src)
        return 3 * nbytes / (time.perf_counter() - t)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    sync(dev)
    best = 0.0
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = max(best, nbytes / (a.elapsed_time(b) / 1e3))
    del src, dst
    return best


# ---------------------------------------------------------------------------- phases


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = CONFIGS[args.config]
        self.dev = torch.device("cuda" if args.backend == "cuda" else "cpu")
        self.prompts = Prompts(self.cfg.vocab_size)
        self.regions: list = []
        self.result: dict[str, Any] = {
            "backend": args.backend,
            "transport": args.transport,
            "load_issuer": args.load_issuer,
            # Layer-wise waits on the GPU stream (pegaflow/gpu_wait.py) or on the host.
            "gpu_waits": args.gpu_waits,
            # What hashes a prompt's blocks (on the TTFT clock): libpegaflow's chain or hashlib.
            "block_hashes": native.hash_impl(),
            "config": args.config,
            "tokens": args.tokens,
            "runs": args.runs,
            "device": torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "lengths": {},
        }
        max_t = max(args.tokens)
        bs = self.cfg.block_size
        decode_blocks = args.decode_requests * -(-(args.decode_prompt + args.decode_tokens) // bs)
        # Two prompts of the longest length (the warm one + a fresh one) and headroom.
        self.num_blocks = max(2 * -(-max_t // bs), decode_blocks) + 64
        # Staging blocks for layer-wise loads (connector/staging.py): the longest prompt's.
        self.staging_blocks = -(-max_t // bs) if args.staging_blocks < 0 else args.staging_blocks
        self.result["staging_blocks"] = self.staging_blocks
        self.max_batched = max(max_t, 2048)
        # Per length: (request id, arrival epoch ms, TTFT ms) of each timed warm run.
        self.warm_requests: dict[str, list[tuple[str, float, float]]] = {}

    def engine(self, mode: str | None, *, model: LlamaModel, record_timeline: bool = False) -> LLMEngine:
        ktc = None
        if mode is not None:
            ktc = KVTransferConfig(
                kv_connector=CONNECTOR_CLASS,
                kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both",
                engine_id=f"ttft-{mode}-{os.getpid()}-{time.monotonic_ns()}",
                kv_connector_extra_config={
                    "pegaflow.addr": self.server_addr,
                    "pegaflow.mode": mode,
                    # "query" loads into staging blocks, which only layer-wise mode has.
                    "pegaflow.load_issuer": self.args.load_issuer
                    if self.args.load_issuer != "query" or (mode == "layerwise" and self.staging_blocks)
                    else "scheduler",
                    "pegaflow.staging_blocks": self.staging_blocks if mode == "layerwise" else 0,
                    "pegaflow.gpu_waits": self.args.gpu_waits,
                },
            )
        alloc = shm_kv_cache_allocator(self.regions) if self.args.backend == "host" else None
        return LLMEngine(
            EngineConfig(
                model=self.cfg,
                num_gpu_blocks=self.num_blocks,
                max_num_batched_tokens=self.max_batched,
                max_num_seqs=max(64, self.args.decode_requests),
                device=str(self.dev),
                kv_transfer_config=ktc,
                record_timeline=record_timeline,
            ),
            model=model,
            kv_cache_allocator=alloc,
        )

    def transformers_prefill(self) -> dict[str, Any]:
        try:
            import transformers
        except ImportError:
            print("transformers: not installed, comparison skipped")
            return {"skipped": "transformers not installed"}
        c = self.cfg
        hf_cfg = transformers.LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=max(c.max_model_len, max(self.args.tokens) + 16),
            torch_dtype=c.torch_dtype,
            attn_implementation="sdpa" if self.dev.type == "cuda" else "eager",
        )
        # Built directly in the model dtype on the device: a float32 8B model would take 32 GB.
        old = torch.get_default_dtype()
        torch.set_default_dtype(c.torch_dtype)
        try:
            with torch.device(self.dev):
                model = transformers.LlamaForCausalLM(hf_cfg).eval()
        finally:
            torch.set_default_dtype(old)
        out: dict[str, Any] = {"version": transformers.__version__}
        for n in self.args.tokens:
            times = []
            for i in range(self.args.warmup + self.args.runs):
                ids = torch.tensor([self.prompts.fresh(n)], device=self.dev)
                sync(self.dev)
                t = time.perf_counter()
                with torch.no_grad():
                    try:
                        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
                    except TypeError:  # older transformers
                        logits = model(input_ids=ids, use_cache=False).logits
                    logits[0, -1].argmax().item()
                if i >= self.args.warmup:
                    times.append(time.perf_counter() - t)
            out[str(n)] = summary([x * 1e3 for x in times])
            print(f"transformers prefill {n}: p50 {out[str(n)]['p50']:.1f} ms")
        del model
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return out

    def run(self) -> dict[str, Any]:
        a = self.args
        if not a.skip_transformers:
            try:
                self.result["transformers"] = self.transformers_prefill()
            except Exception as e:  # the comparison must not cost the PegaFlow measurements
                print(f"transformers comparison failed, skipped: {type(e).__name__}: {e}")
                self.result["transformers"] = {"error": f"{type(e).__name__}: {e}"}
                gc.collect()
                if self.dev.type == "cuda":
                    torch.cuda.empty_cache()
        uds_dir = tempfile.mkdtemp(prefix="pf-ttft-") if a.transport == "uds" else None
        try:
            self.server, self.server_addr = start_server(
                a.backend, a.pool_size, a.transfer_path if a.backend == "cuda" else None, uds_dir
            )
        except BaseException:
            if uds_dir:
                shutil.rmtree(uds_dir, ignore_errors=True)
            raise
        try:
            model = LlamaModel(self.cfg, self.dev, seed=0)
            self.result["kv_link_gbps"] = h2d_rate(
                self.cfg.kv_bytes_per_token() * max(a.tokens), self.dev
            ) / 1e9
            # Both modes side by side, each length measured in both before the next length:
            # a warm prompt is then still in the server's pool (cold runs keep saving new ones).
            lw = self.engine("layerwise", model=model)
            asy = self.engine("async", model=model)
            try:
                for n in a.tokens:
                    prompt = self.prompts.fresh(n)
                    stash: dict[str, Any] = {}
                    res = self.length_layerwise(lw, n, prompt, stash)
                    res["warm_async"] = self.length_async(asy, n, prompt, stash)
                    self.result["lengths"][str(n)] = res
                    del stash
                self.relink(max(a.tokens))
                asy.shutdown()
                asy = None
                gc.collect()
                # Decode: PegaFlow on (the layer-wise engine) vs off (no connector), interleaved.
                plain = self.engine(None, model=model)
                if a.profile and self.dev.type == "cuda":
                    self.result["profile"] = self.profile(lw, plain, str(max(a.tokens)))
                if a.decode_requests > 0:
                    self.result["decode"] = self.decode_on_off(lw, plain)
            finally:
                lw.shutdown()
                if asy is not None:
                    asy.shutdown()
        finally:
            self.server.stop(grace_s=15)
            logs = self.server.logs()
            # The socket's directory and the log file are this run's; PEGAFLOW_TTFT_SERVER_LOG_COPY keeps the log.
            self.server.remove_log()
            if uds_dir:
                shutil.rmtree(uds_dir, ignore_errors=True)
            keep = os.environ.get("PEGAFLOW_TTFT_SERVER_LOG_COPY")
            if keep:  # the server's log lines, for reading its side of each RPC
                with open(keep, "w") as f:
                    f.write(logs)
            for n, runs in self.warm_requests.items():
                split = copy_breakdown(logs, runs)
                if split and n in self.result["lengths"]:
                    self.result["lengths"][n]["warm_copy_breakdown"] = split
                    print(
                        f"{n:>6} tokens  warm runs, ms since arrival (p50): copy submitted "
                        f"{split['submitted_ms']['p50']:.2f}, copy done {split['done_ms']['p50']:.2f} "
                        f"(copy {split['copy_ms']['p50']:.2f}); first token {split['after_copy_ms']['p50']:.2f} after it"
                    )
            for r in self.regions:
                r.close()
        self.targets()
        return self.result

    def profile(self, lw: LLMEngine, plain: LLMEngine, n: str) -> dict[str, Any]:
        """torch.profiler over one GPU-hit step (16 new tokens over the cached prompt) and one
        decode step of the decode batch: where the step's time goes, kernel by kernel."""
        from torch.profiler import ProfilerActivity, profile

        out: dict[str, Any] = {}
        prompt = self._prof_prompt
        first_token(lw, prompt)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            first_token(lw, prompt)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        print(f"profile: GPU-hit step, {n} tokens\n{table}\n{cpu}")
        out["gpu_hit"] = table
        out["gpu_hit_cpu"] = cpu
        prompts = [self.prompts.fresh(self.args.decode_prompt) for _ in range(self.args.decode_requests)]
        reqs = [plain.add_request(p, max_tokens=8) for p in prompts]
        while any(r.num_output_tokens < 2 for r in reqs):
            plain.step()
        sync(self.dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            plain.step()
            sync(self.dev)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        print(f"profile: decode step, {len(reqs)} requests\n{table}")
        out["decode"] = table
        plain.drain()
        plain.reset_prefix_cache()
        # Host side of whole decode runs, on vs off: which Python functions the connector adds.
        import cProfile
        import io
        import pstats

        for name, eng in (("on", lw), ("off", plain)):
            pr = cProfile.Profile()
            pr.enable()
            self.decode_run(eng)
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
            print(f"cProfile: decode run, PegaFlow {name}\n{buf.getvalue()}")
            out[f"decode_cprofile_{name}"] = buf.getvalue()
        return out

    def cold_run(self, eng: LLMEngine, n: int) -> float:
        ttft, *_ = first_token(eng, self.prompts.fresh(n))
        eng.reset_prefix_cache()  # drains the delayed frees too (not timed)
        return ttft

    def warm_run(self, eng: LLMEngine, prompt: list[int], *, timeline: bool = False):
        assert eng.reset_prefix_cache(), "reset_prefix_cache refused: blocks still in use"
        eng.runner.record_timeline = timeline
        try:
            return first_token(eng, prompt)
        finally:
            eng.runner.record_timeline = False

    def length_layerwise(self, eng: LLMEngine, n: int, prompt: list[int], st: dict) -> dict[str, Any]:
        """cold, gpu_hit, warm and warm_ltc for length n; fills `st` with the cold KV of `prompt`."""
        a = self.args
        bs = self.cfg.block_size
        res: dict[str, Any] = {}
        for _ in range(a.warmup):
            self.cold_run(eng, n)
        res["cold"] = summary([self.cold_run(eng, n) * 1e3 for _ in range(a.runs)])
        # The warm prompt, computed cold once; its KV stashed before the reset.
        _, req, cold_logits, table, _ = first_token(eng, prompt)
        eng.drain()
        nfull = (n - 1) // bs
        st["logits"] = cold_logits
        st["token"] = req.output_token_ids[0]
        st["kv"] = [eng.runner.kv_caches[name][:, table[:nfull]].clone() for name in eng.runner.layer_names]
        # GPU prefix-cache hit: the floor, and the warm step's own compute time. Its logits are
        # the reference for the loaded runs: the same step over the same KV.
        self._prof_prompt = prompt
        first_token(eng, prompt)
        eng.runner.record_timeline = True
        try:
            _, hreq, hlogits, _, htl = first_token(eng, prompt)
        finally:
            eng.runner.record_timeline = False
        st["hit_logits"] = hlogits
        st["hit_token"] = hreq.output_token_ids[0]
        res["gpu_hit_phases_ms"] = phases_ms(eng, hreq)
        if htl:
            res["gpu_hit_forward_ms"] = htl[-1].compute_end_ms - htl[0].compute_start_ms
        floor = [first_token(eng, prompt)[0] * 1e3 for _ in range(a.runs)]
        res["gpu_hit"] = summary(floor)
        # Warm from PegaFlow, layer-wise.
        for _ in range(a.warmup):
            self.warm_run(eng, prompt)
        with ControlPlaneClock() as clock:
            _, wreq, wlogits, wtable, timeline = self.warm_run(eng, prompt, timeline=True)
        res["warm_phases_ms"] = phases_ms(eng, wreq, clock.marks)
        res["warm_control_plane_epoch_ms"] = clock.epoch_ms
        if timeline:  # layer 0 seen usable (waits are timed from just after pre_forward_done)
            res["warm_phases_ms"]["layer0_landed"] = (
                res["warm_phases_ms"]["pre_forward_done"] + timeline[0].wait_end_ms
            )
        res["correctness"] = self.check(n, st, eng, wreq, wlogits, wtable)
        res["timeline"] = [t.__dict__ for t in timeline or []]
        if timeline:
            # The warm step's forward alone, first layer's start to last layer's end (waits included).
            res["warm_forward_ms"] = timeline[-1].compute_end_ms - timeline[0].compute_start_ms
            res["warm_wait_ms"] = sum(t.wait_end_ms - t.wait_start_ms for t in timeline)
        warm = [self.warm_run(eng, prompt) for _ in range(a.runs)]
        res["warm"] = summary([w[0] * 1e3 for w in warm])
        # Each timed run's request id, arrival (wall clock) and TTFT, to pair with the server's log.
        self.warm_requests[str(n)] = [
            (w[1].request_id, (w[1].arrival_time + EPOCH_MINUS_PERF_S) * 1e3, w[0] * 1e3) for w in warm
        ]
        del warm
        # Warm, load-then-compute.
        eng.runner.load_then_compute = True
        try:
            self.warm_run(eng, prompt)
            res["warm_ltc"] = summary([self.warm_run(eng, prompt)[0] * 1e3 for _ in range(a.runs)])
        finally:
            eng.runner.load_then_compute = False
        loaded_bytes = wreq.num_external_computed_tokens * self.cfg.kv_bytes_per_token()
        res["loaded_tokens"] = wreq.num_external_computed_tokens
        res["loaded_bytes"] = loaded_bytes
        res["link_ms"] = loaded_bytes / (self.result["kv_link_gbps"] * 1e9) * 1e3
        res["warm_compute_ms"] = res["gpu_hit"]["p50"]
        print(
            f"{n:>6} tokens  cold {res['cold']['p50']:8.2f}  warm {res['warm']['p50']:7.2f} "
            f"(p99 {res['warm']['p99']:.2f})  ltc {res['warm_ltc']['p50']:7.2f}  "
            f"gpu-hit {res['gpu_hit']['p50']:7.2f}  link {res['link_ms']:6.2f} ms  "
            f"correct={res['correctness']['ok']}"
        )
        return res

    def relink(self, tokens: int) -> None:
        """Measures the link again after the runs and keeps the faster figure (the target's
        `warm / link` is then the stricter one): the first measure, taken once before the runs,
        read 47 GB/s in one run on an H200 where a plain pinned copy measured 54-55 GB/s minutes
        before (`ttft-cuda-diag7.json`), which made the warm step look 1.01x the link."""
        first = self.result["kv_link_gbps"]
        again = h2d_rate(self.cfg.kv_bytes_per_token() * tokens, self.dev) / 1e9
        self.result["kv_link_gbps_measures"] = [first, again]
        best = max(first, again)
        self.result["kv_link_gbps"] = best
        for res in self.result["lengths"].values():
            res["link_ms"] = res["loaded_bytes"] / (best * 1e9) * 1e3

    def check(self, n: int, st: dict, eng: LLMEngine, req, logits, table) -> dict[str, Any]:
        nfull = (n - 1) // self.cfg.block_size
        loaded = req.num_external_computed_tokens // self.cfg.block_size
        equal = loaded == nfull and all(
            torch.equal(eng.runner.kv_caches[name][:, table[:nfull]], st["kv"][i])
            for i, name in enumerate(eng.runner.layer_names)
        )
        w = logits.float()
        cold, hit = st["logits"].float().to(w.device), st["hit_logits"].float().to(w.device)

        def cos(x: torch.Tensor, y: torch.Tensor) -> float:
            return torch.nn.functional.cosine_similarity(x, y, dim=0).item()

        token = req.output_token_ids[0]
        out = {
            "blocks_loaded": loaded,
            "blocks_expected": nfull,
            "blocks_byte_equal": bool(equal),
            # vs the engine's own prefix hit: the same step over the same KV (same kernels).
            "same_first_token_as_gpu_hit": token == st["hit_token"],
            "logits_bit_equal_to_gpu_hit": bool(torch.equal(w, hit)),
            "logits_cosine_vs_gpu_hit": cos(w, hit),
            # vs the cold prefill: other kernels (a 10K-row GEMM tiles and sums differently from a
            # 16-row one), so bf16 roundings differ; with random weights the top logits are
            # near-ties, so the argmax may flip: reported, not required.
            "same_first_token_as_cold": token == st["token"],
            "logits_cosine_vs_cold": cos(w, cold),
            "logits_max_abs_diff_vs_cold": (w - cold).abs().max().item(),
            # The bar for "close to cold": the engine's own GPU prefix-cache hit, which computes
            # the same step over the same KV and differs from cold by those kernels alone.
            "gpu_hit_cosine_vs_cold": cos(hit, cold),
        }
        out["ok"] = (
            out["blocks_byte_equal"]
            and out["same_first_token_as_gpu_hit"]
            and (out["logits_bit_equal_to_gpu_hit"] or out["logits_cosine_vs_gpu_hit"] >= 0.9999)
            and out["logits_cosine_vs_cold"] >= min(0.999, out["gpu_hit_cosine_vs_cold"] - 1e-4)
        )
        return out

    def length_async(self, eng: LLMEngine, n: int, prompt: list[int], st: dict) -> dict[str, Any]:
        a = self.args
        for _ in range(a.warmup):
            self.warm_run(eng, prompt)
        _, req, logits, table, _ = self.warm_run(eng, prompt)
        # Checked before the timed runs, which reuse (and overwrite) the same blocks.
        correctness = self.check(n, st, eng, req, logits, table)
        res = summary([self.warm_run(eng, prompt)[0] * 1e3 for _ in range(a.runs)])
        res["correctness"] = correctness
        print(f"{n:>6} tokens  warm async {res['p50']:7.2f} ms (p99 {res['p99']:.2f})")
        return res

    def decode_run(self, eng: LLMEngine) -> DecodeRun:
        """`decode_requests` fresh prompts (0 % hits) × `decode_tokens` each: (tokens/s of the
        decode phase, from the step after the last first token to the end; tokens/s end to end,
        admission and the prefill step included; each decode-phase step's host time in ms; each
        decode-phase step's host phases in ms, STEP_PHASES)."""
        a = self.args
        eng.reset_prefix_cache()
        prompts = [self.prompts.fresh(a.decode_prompt) for _ in range(a.decode_requests)]
        phases: dict[str, list[float]] = {name: [] for name, _, _ in STEP_PHASES}
        eng.runner.record_phases = True
        gc.collect()
        gc.disable()
        try:
            sync(self.dev)
            t0 = time.perf_counter()
            reqs = [eng.add_request(p, max_tokens=a.decode_tokens) for p in prompts]
            while any(r.num_output_tokens == 0 for r in reqs):
                eng.step()
            t1 = time.perf_counter()
            steps: list[float] = []
            ts = t1
            while not all(r.is_finished() for r in reqs):
                eng.step()
                te = time.perf_counter()
                steps.append((te - ts) * 1e3)
                ts = te
                ph = eng.last_runner_output.phases
                if ph:  # a TP engine's steps carry none
                    for name, a0, a1 in STEP_PHASES:
                        phases[name].append((ph[a1] - ph[a0]) * 1e3)
            sync(self.dev)
            t2 = time.perf_counter()
        finally:
            gc.enable()
            eng.runner.record_phases = False
        n = a.decode_requests
        return n * (a.decode_tokens - 1) / (t2 - t1), n * a.decode_tokens / (t2 - t0), steps, phases

    def decode_on_off(self, on: LLMEngine, plain: LLMEngine) -> dict[str, Any]:
        """PegaFlow on (the layer-wise engine: every new block saved, 0 % hits) vs off: the same
        engine with its connector detached (same KV cache, graphs and memory, so only PegaFlow
        differs), and a separate plain engine over the same weights (an A/A check of the
        off engine: two engines without PegaFlow that differ only in where their memory lies).
        One warm-up each, then `decode_repeats` rounds, each running the three in a rotating
        order so that drift (clocks, heat) hits all alike; medians, and the mean of each round's
        ratios (which cancels slow drift)."""
        variants = {
            "on": lambda: self.decode_run(on),
            "off": lambda: self.decode_detached(on),
            "plain": lambda: self.decode_run(plain),
        }
        for run in variants.values():
            run()  # warm-up
        orders = list(itertools.permutations(variants))
        runs: dict[str, list[DecodeRun]] = {k: [] for k in variants}
        # The server's CPU time while each variant runs (on: until its saves are done too).
        server_cpu_s = {k: 0.0 for k in variants}
        # The same, per server thread name (which thread's CPU: the JS thread, the copy's).
        thread_cpu_s: dict[str, dict[str, float]] = {k: {} for k in variants}
        for i in range(self.args.decode_repeats):
            for which in orders[i % len(orders)]:
                c0, t0 = self.server.cpu_seconds(), self.server.cpu_seconds_by_thread()
                runs[which].append(variants[which]())
                if which == "on":
                    on.drain()
                server_cpu_s[which] += self.server.cpu_seconds() - c0
                for name, sec in self.server.cpu_seconds_by_thread().items():
                    used = sec - t0.get(name, 0.0)
                    thread_cpu_s[which][name] = thread_cpu_s[which].get(name, 0.0) + used
        res: dict[str, Any] = {}
        for which, rs in runs.items():
            # Step by step (the same index is the same point of every run: a block boundary
            # every block_size steps): where a slower variant loses its time.
            by_index = [statistics.fmean(col) for col in zip(*(r[2] for r in rs))]
            every = [x for r in rs for x in r[2]]
            res[which] = {
                # Where a step's host time goes: each phase's median over every step of every round.
                "phase_ms_p50": {
                    name: round(statistics.median([x for r in rs for x in r[3][name]] or [math.nan]), 4)
                    for name, _, _ in STEP_PHASES
                },
                # Server CPU per decode step, ms (ticks of 10 ms: a sum over every round).
                "server_cpu_ms_per_step": round(1e3 * server_cpu_s[which] / max(1, len(every)), 4),
                # ... by thread name, the busiest first (threads alive at the end of each round).
                "server_cpu_ms_per_step_by_thread": {
                    name: round(1e3 * sec / max(1, len(every)), 4)
                    for name, sec in sorted(thread_cpu_s[which].items(), key=lambda kv: -kv[1])
                    if sec > 0
                },
                "decode_tokens_per_s": statistics.median(r[0] for r in rs),
                "e2e_tokens_per_s": statistics.median(r[1] for r in rs),
                "runs": [r[:2] for r in rs],
                "step_ms": {
                    "p50": statistics.median(every),
                    "mean": statistics.fmean(every),
                    "p99": sorted(every)[int(0.99 * (len(every) - 1))],
                    "by_index": [round(x, 3) for x in by_index],
                },
            }
        res["on_stats"] = on.worker_connector.pegaflow_stats() if on.worker_connector else {}

        def slower(a: str, b: str) -> tuple[float, list[float]]:
            ratios = [x[0] / y[0] for x, y in zip(runs[a], runs[b])]
            # How sure the rounds' mean is: a round swings a few % on a noisy host.
            lo, hi = mean_ci95([1 - x for x in ratios])
            res[f"ci95_{a}_vs_{b}"] = [lo, hi]
            return 1 - statistics.fmean(ratios), ratios

        res["paired_slowdown"], pairs = slower("on", "off")
        res["paired_slowdown_vs_plain"], _ = slower("on", "plain")
        res["aa_plain_vs_off"], aa = slower("plain", "off")
        ci = {k: f"95 % CI {100 * res[k][0]:+.2f}..{100 * res[k][1]:+.2f} %"
              for k in ("ci95_on_vs_off", "ci95_on_vs_plain", "ci95_plain_vs_off")}  # fmt: skip
        print(
            f"decode tokens/s (median of {self.args.decode_repeats}): on {res['on']['decode_tokens_per_s']:.1f}, "
            f"off (same engine, connector detached) {res['off']['decode_tokens_per_s']:.1f}, "
            f"plain engine {res['plain']['decode_tokens_per_s']:.1f}; on/off per round "
            f"{' '.join(f'{x:.3f}' for x in pairs)} (mean: {100 * res['paired_slowdown']:.2f} % slower, "
            f"{ci['ci95_on_vs_off']}; vs plain {100 * res['paired_slowdown_vs_plain']:.2f} %, "
            f"{ci['ci95_on_vs_plain']}); A/A plain/off "
            f"{' '.join(f'{x:.3f}' for x in aa)} (mean: {100 * res['aa_plain_vs_off']:.2f} %, {ci['ci95_plain_vs_off']})"
        )
        print(
            "decode step phases, ms p50 ("
            + " ".join(name for name, _, _ in STEP_PHASES) + "): "
            + "; ".join(
                f"{k} " + " ".join(f"{res[k]['phase_ms_p50'][name]:.3f}" for name, _, _ in STEP_PHASES)
                for k in variants
            )
        )
        print(
            "server CPU ms per decode step: "
            + "; ".join(f"{k} {res[k]['server_cpu_ms_per_step']:.3f}" for k in variants)
            + " (on, by thread: "
            + ", ".join(f"{n} {v:.3f}" for n, v in res["on"]["server_cpu_ms_per_step_by_thread"].items())
            + ")"
        )
        print(
            "decode step ms (p50 / mean / p99): "
            + "; ".join(f"{k} {v['step_ms']['p50']:.3f} / {v['step_ms']['mean']:.3f} / {v['step_ms']['p99']:.3f}"
                        for k, v in res.items() if isinstance(v, dict) and "step_ms" in v)
        )
        on.drain()
        plain.drain()
        return res

    def decode_detached(self, eng: LLMEngine) -> DecodeRun:
        """`decode_run` of `eng` with its connector detached: no hook called, nothing queried or
        saved, as an engine started without `kv_transfer_config`."""
        eng.drain()
        sched, worker = eng.scheduler.connector, eng.runner.connector
        eng.scheduler.connector = eng.runner.connector = None
        try:
            out = self.decode_run(eng)
            eng.drain()
        finally:
            eng.scheduler.connector, eng.runner.connector = sched, worker
        return out

    def targets(self) -> None:
        r = self.result
        t: dict[str, Any] = {}
        longest = str(max(self.args.tokens))
        L = r["lengths"][longest]
        cold, warm, ltc = L["cold"]["p50"], L["warm"]["p50"], L["warm_ltc"]["p50"]
        link, comp = L["link_ms"], L["warm_compute_ms"]
        t["warm >= 11x faster than cold at the longest prompt"] = {
            "value": cold / warm, "limit": 11.0, "pass": cold / warm >= 11.0,
        }  # fmt: skip
        t["warm <= 1.15 x max(KV link time, warm compute)"] = {
            "value": warm / max(link, comp), "limit": 1.15, "pass": warm <= 1.15 * max(link, comp),
        }  # fmt: skip
        t["warm p99 <= 1.3 x p50"] = {
            "value": L["warm"]["p99"] / warm, "limit": 1.3, "pass": L["warm"]["p99"] <= 1.3 * warm,
        }  # fmt: skip
        t["layer-wise beats load-then-compute by >= min(load, compute)"] = {
            "value": ltc - warm, "limit": min(link, comp), "pass": ltc - warm >= min(link, comp),
        }  # fmt: skip
        on = r["decode"]["on"]["decode_tokens_per_s"] if "decode" in r else 0.0
        off = r["decode"]["off"]["decode_tokens_per_s"] if "decode" in r else 0.0
        if off > 0:
            t["decode with PegaFlow on at 0% hits <= 1% slower than off"] = {
                "value": 1 - on / off, "limit": 0.01, "pass": on >= 0.99 * off,
                # The rounds' paired mean slowdown and its 95 % interval: how far the medians can be trusted.
                "rounds_mean": r["decode"]["paired_slowdown"], "rounds_ci95": r["decode"]["ci95_on_vs_off"],
            }  # fmt: skip
        else:
            t["decode with PegaFlow on at 0% hits <= 1% slower than off"] = {"pass": None, "skipped": "no decode run"}
        hf = r.get("transformers", {}).get(longest)
        if hf:
            t["cold prefill no slower than transformers'"] = {
                "value": cold / hf["p50"], "limit": 1.0, "pass": cold <= hf["p50"],
            }  # fmt: skip
        else:
            t["cold prefill no slower than transformers'"] = {"pass": None, "skipped": "no transformers"}
        t["correctness (byte-equal blocks; = gpu hit: same token, logits bit-equal or cos >= 0.9999; vs cold cos >= min(0.999, the gpu hit's own))"] = {
            "pass": all(
                v["correctness"]["ok"] and v["warm_async"]["correctness"]["ok"] for v in r["lengths"].values()
            )
        }
        r["targets"] = t


# ---------------------------------------------------------------------------- output


def print_table(r: dict[str, Any]) -> None:
    print()
    print(
        f"TTFT (ms), {r['config']} on {r['device']}, backend {r['backend']}, {r['runs']} runs, "
        f"block hashes by {r.get('block_hashes', '?')}"
    )
    hdr = f"{'tokens':>7} {'phase':<13} {'p50':>9} {'p99':>9} {'vs cold':>8}"
    print(hdr)
    print("-" * len(hdr))
    for n, L in r["lengths"].items():
        cold = L["cold"]["p50"]
        rows = [
            ("cold", L["cold"]),
            ("warm", L["warm"]),
            ("warm_ltc", L["warm_ltc"]),
            ("warm_async", L["warm_async"]),
            ("gpu_hit", L["gpu_hit"]),
        ]
        hf = r.get("transformers", {}).get(n)
        if hf:
            rows.append(("transformers", hf))
        for name, s in rows:
            print(f"{n:>7} {name:<13} {s['p50']:9.2f} {s['p99']:9.2f} {cold / s['p50']:7.1f}x")
        print(f"{n:>7} {'kv link':<13} {L['link_ms']:9.2f} {'':>9}   ({L['loaded_bytes'] / 1e9:.3f} GB)")
        if "gpu_hit_forward_ms" in L:
            print(f"{n:>7} {'hit forward':<13} {L['gpu_hit_forward_ms']:9.2f} {'':>9}   (GPU-hit step, first layer to last)")
        for key in ("gpu_hit_phases_ms", "warm_phases_ms"):
            if L.get(key):
                print(f"{n:>7} {key[:-10]:<13} " + "  ".join(f"{k} {v:.2f}" for k, v in L[key].items()))
        if "warm_forward_ms" in L:
            print(
                f"{n:>7} {'warm forward':<13} {L['warm_forward_ms']:9.2f} {'':>9}   "
                f"(of which waiting for loads {L['warm_wait_ms']:.2f})"
            )
    if "decode" in r:
        d = r["decode"]
        print()
        print(
            f"decode tokens/s (decode phase, median): on {d['on']['decode_tokens_per_s']:.1f}, "
            f"off {d['off']['decode_tokens_per_s']:.1f}, plain engine {d['plain']['decode_tokens_per_s']:.1f}; end to end (admission + prefill too): "
            f"on {d['on']['e2e_tokens_per_s']:.1f}, off {d['off']['e2e_tokens_per_s']:.1f}"
        )
    print()
    for name, v in r["targets"].items():
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[v["pass"]]
        extra = f"  ({v['value']:.3f} vs {v['limit']})" if "value" in v else ""
        print(f"[{verdict}] {name}{extra}")


def draw_chart(r: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: chart skipped")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    phases = ["cold", "warm", "warm_ltc", "warm_async", "gpu_hit"]
    lengths = list(r["lengths"])
    width = 0.8 / len(phases)
    for j, ph in enumerate(phases):
        xs = [i + j * width for i in range(len(lengths))]
        ax1.bar(xs, [r["lengths"][n][ph]["p50"] for n in lengths], width, label=ph)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(lengths))])
    ax1.set_xticklabels([f"{n} tokens" for n in lengths])
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT p50 (ms, log)")
    ax1.set_title("cold vs warm")
    ax1.legend()
    tl = r["lengths"][lengths[-1]]["timeline"]
    # With layer waits on the GPU stream, a wait is timed on the GPU clock (docs/python.md).
    wait_label = "wait for load (GPU stream)" if r.get("gpu_waits") else "wait for load (CPU)"
    for t in tl:
        y = t["layer"]
        ax2.barh(y - 0.2, t["wait_end_ms"] - t["wait_start_ms"], left=t["wait_start_ms"], height=0.4,
                 color="tab:orange", label=wait_label if y == 0 else None)  # fmt: skip
        ax2.barh(y + 0.2, t["compute_end_ms"] - t["compute_start_ms"], left=t["compute_start_ms"], height=0.4,
                 color="tab:blue", label="layer compute (GPU)" if y == 0 else None)  # fmt: skip
    ax2.set_yticks(range(0, len(tl), max(1, len(tl) // 16)))
    ax2.invert_yaxis()
    ax2.set_xlabel("ms from step start")
    ax2.set_ylabel("layer")
    ax2.set_title(f"warm layer-wise step, {lengths[-1]} tokens")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options with their per-backend defaults filled in (bench/decode_host.py
    builds its Bench from these too)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    p.add_argument("--config", choices=sorted(CONFIGS), default=None)
    p.add_argument("--tokens", default=None, help="comma-separated prompt lengths")
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool-size", default=None)
    p.add_argument("--transfer-path", default="auto", choices=["auto", "kernel", "dma"])
    p.add_argument(
        "--staging-blocks", type=int, default=-1,
        help="pegaflow.staging_blocks of the layer-wise engine (-1: the longest prompt's blocks; 0: off)",
    )
    p.add_argument("--decode-requests", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=None)
    p.add_argument("--decode-prompt", type=int, default=None)
    p.add_argument(
        "--transport",
        choices=["uds", "tcp"],
        default="uds",
        help="how the engine reaches the server: its Unix socket (default) or TCP loopback",
    )
    p.add_argument(
        "--gpu-waits",
        choices=["1", "0"],
        default="1",
        help="pegaflow.gpu_waits: layer-wise waits on the GPU stream (1, the default) or on the host (0)",
    )
    p.add_argument(
        "--load-issuer",
        choices=["scheduler", "worker", "query"],
        default="query",
        help="who sends the Load RPC: the probe itself (query, the default: the load rides on "
        "QueryPrefetch into staging blocks; layer-wise with staging blocks only, the other engines "
        "use scheduler), the scheduler as soon as it allocated the blocks, or the worker in start_load_kv",
    )
    p.add_argument(
        "--decode-repeats", type=int, default=8, help="rounds of on, off and the plain engine, in a rotating order"
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of a GPU-hit and a decode step")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--out", default=None, help="JSON path (default bench/results/ttft-<backend>.json; its chart beside it, .png)"
    )
    a = p.parse_args(argv)
    gpu = a.backend == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--backend cuda needs a CUDA GPU; use --backend host --config tiny here")
    a.config = a.config or ("llama-3.1-8b" if gpu else "tiny")
    a.tokens = [int(x) for x in (a.tokens or ("4096,10240" if gpu else "256,1024")).split(",")]
    a.runs = a.runs or (20 if gpu else 5)
    a.pool_size = a.pool_size or ("16gb" if gpu else "256mb")
    a.decode_tokens = a.decode_tokens or (128 if gpu else 16)
    a.decode_prompt = a.decode_prompt or (256 if gpu else 64)
    if not gpu:
        a.decode_requests = min(a.decode_requests, 8)
    return a


def main() -> None:
    a = parse_args()
    out = a.out or os.path.join(ROOT, "bench", "results", f"ttft-{a.backend}.json")
    torch.manual_seed(0)
    r = Bench(a).run()
    print_table(r)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(r, f, indent=1, default=float)
    print(f"json: {out}")
    draw_chart(r, out[: -len(".json")] + ".png" if out.endswith(".json") else out + ".png")


if __name__ == "__main__":
    main()
