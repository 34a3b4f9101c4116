"""One TP rank of the mini engine, as its own process (test_minivllm_tp.py starts `tp_size` of
them): joins the gloo group, builds the engine with `PegaflowConnector` on a host-backend server
that serves one device per rank (this rank registers device `tp_rank`), and either drives
(rank 0: cold request, reset, scribble, warm request; the result goes to a JSON file) or serves
the driver (other ranks).

    python3 minivllm_tp_rank.py RANK TP_SIZE MASTER_PORT SERVER_ADDR UID MODE OUT_JSON
"""

from __future__ import annotations

import datetime
import json
import os
import random
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pegaflow.minivllm import EngineConfig, LLMEngine  # noqa: E402
from pegaflow.minivllm.model_runner import shm_kv_cache_allocator  # noqa: E402

from minivllm_runs import connector_config, run  # noqa: E402
from tiny_model import TINY  # noqa: E402

#: Collectives wait at most this long for the other ranks (a dead peer fails the test, not hangs it).
GROUP_TIMEOUT_S = 120


def main() -> None:
    rank, tp, port, addr, uid, mode, out = sys.argv[1:8]
    rank, tp = int(rank), int(tp)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    # "layerwise+staging": layer-wise through staging blocks (connector/staging.py);
    # "+query": the loads of both ranks ride on the probe (connector/query_issuer.py);
    # "+noengineid": no engine id given (each rank's config makes its own uuid4, as vLLM's
    # default does; the engine hands the driver's to every rank), the instance id set instead.
    default_id = "+noengineid" in mode
    ktc = connector_config(
        None if default_id else f"{uid}-tp{tp}", addr, f"ns-{uid}", mode=mode.split("+")[0],
        staging_blocks=32 if "+staging" in mode else None,
        load_issuer="query" if mode.endswith("+query") else None,
        device_id=rank,  # one server device per rank
        instance_id=f"{uid}-tp{tp}" if default_id else None,
    )
    regions: list = []
    eng = LLMEngine(
        EngineConfig(model="tiny", num_gpu_blocks=64, kv_transfer_config=ktc, tensor_parallel_size=tp, tp_rank=rank),
        kv_cache_allocator=shm_kv_cache_allocator(regions),
    )
    try:
        if rank != 0:
            eng.run_worker()
            return
        rng = random.Random(uid)
        prompt = [rng.randrange(TINY.vocab_size) for _ in range(150)]
        nfull = (len(prompt) - 1) // TINY.block_size
        cold, cold_logits, cold_table, _ = run(eng, prompt, max_tokens=3)
        eng.drain(timeout_s=60)
        stash = eng.collective_rpc("kv_blocks", cold_table[:nfull])
        assert eng.reset_prefix_cache()
        eng.collective_rpc("fill_kv", 7.0)  # only a real load restores the blocks
        warm, warm_logits, warm_table, _ = run(eng, prompt, max_tokens=3)
        got = eng.collective_rpc("kv_blocks", warm_table[:nfull])
        eng.drain(timeout_s=60)
        differing = [
            f"rank {r} {name}"
            for r in range(tp)
            for name in stash[r]
            if not torch.equal(stash[r][name], got[r][name])
        ]
        result = {
            "cold_tokens": cold.output_token_ids,
            "warm_tokens": warm.output_token_ids,
            "cold_external": cold.num_external_computed_tokens,
            "warm_external": warm.num_external_computed_tokens,
            "expected_external": nfull * TINY.block_size,
            "logits_max_diff": float((warm_logits - cold_logits).abs().max()),
            "kv_shapes": [list(next(iter(s.values())).shape) for s in stash],
            "differing_layers": differing,
            "loads_per_rank": eng.worker_connector.pegaflow_stats().get("loads", 0),
            "query_loads": eng.scheduler_connector.pegaflow_stats().get("query_loads", 0),
        }
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        eng.shutdown()
        for r in regions:
            r.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
