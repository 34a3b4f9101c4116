"""The connector driven the way vLLM's own code drives it, where that differs from what the
vLLM-shaped engines (tests/vllm_driver.py, pegaflow.minivllm) exercise. Each test names the vLLM
file it follows (vllm-project/vllm @ 003df2961dd8830c317a61f9745ccd557da9fa06)."""

from __future__ import annotations

import logging

import pytest
import torch

from pegaflow.connector.vllm import ConnectorSettings, PegaflowConnector
from pegaflow.connector.vllm_api import KVConnectorRole, ModelConfig, ParallelConfig
from pegaflow.regions import ShmRegion

from vllm_driver import BLOCK, HEAD_DIM, HEADS, vllm_config


def test_vllms_model_config_counts_the_layers_of_this_processs_pipeline_stage():
    # vllm/config/model.py ModelConfig.get_num_layers -> get_layers_start_end_indices: the stage is
    # (parallel_config.rank // tensor_parallel_size) % pipeline_parallel_size, and
    # vllm/distributed/utils.py get_pp_indices gives an uneven split's extra layers to the stages
    # before the last. The stand-in must count the same way, or tests miss what real vLLM does.
    m = ModelConfig(num_layers=32)
    stages = [m.get_num_layers(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3, rank=r))
              for r in (0, 1, 2, 3, 4, 5)]
    assert stages == [11, 11, 11, 11, 10, 10]
    assert m.get_total_num_hidden_layers() == 32
    assert [ModelConfig(num_layers=4).get_num_layers(ParallelConfig(pipeline_parallel_size=3, rank=r))
            for r in range(3)] == [1, 2, 1]


def _stage_config(addr: str, uid: str, stage: int, num_layers: int = 4, pp: int = 3):
    cfg = vllm_config(addr, uid, "tiny-" + uid, "layerwise")
    cfg.model_config.num_layers = num_layers
    cfg.parallel_config.pipeline_parallel_size = pp
    # vLLM's worker sets parallel_config.rank to its global rank, TP innermost (vllm/v1/worker/
    # worker_base.py WorkerBase.__init__), before its connector is built with that config.
    cfg.parallel_config.rank = stage
    return cfg


def test_every_pipeline_stage_and_the_scheduler_derive_one_namespace(uid):
    # 32 layers on 3 stages: vLLM's stages hold 11, 11 and 10 (see above). The scheduler's process
    # has rank 0. All of them must name one namespace.
    names = {
        ConnectorSettings.from_vllm(_stage_config("127.0.0.1:1", uid, s, num_layers=32), env={}).namespace
        for s in range(3)
    }
    assert len(names) == 1, names


def test_the_workers_of_unevenly_split_pipeline_stages_all_register(server, uid):
    # 4 layers on 3 stages: stage 0 holds layer 0, stage 1 layers 1-2. Each worker connector
    # registers its stage's KV under the engine's instance (vllm/v1/worker/gpu/kv_connector.py
    # ActiveKVConnector.__init__ -> register_kv_caches); the server refuses a rank of an instance
    # registered under another namespace.
    nblocks = 8
    per_layer = 2 * nblocks * BLOCK * HEADS * HEAD_DIM * 2
    made = []
    try:
        first = 0
        for stage in range(2):
            cfg = _stage_config(server.addr, uid, stage)
            n = cfg.model_config.get_num_layers(cfg.parallel_config)
            w = PegaflowConnector(cfg, KVConnectorRole.WORKER, None)
            region = ShmRegion(per_layer * n)
            made.append((w, region))
            kv = {
                f"model.layers.{first + i}.self_attn.attn": region.torch(
                    torch.float16, (2, nblocks, BLOCK, HEADS, HEAD_DIM), offset=i * per_layer
                )
                for i in range(n)
            }
            first += n
            w.register_kv_caches(kv)
            assert w._w().registration is not None and w._w().pp_rank == stage
    finally:
        for w, region in made:
            w.shutdown()
            region.close()


def test_a_scheduler_side_load_issuer_under_vllms_async_scheduling_is_warned_about(uid, caplog):
    # vllm/config/vllm.py VllmConfig.__post_init__ resolves scheduler_config.async_scheduling=None
    # to True unless an option is incompatible, so a plain `vllm serve` (the README's line) runs
    # with it: the engine core schedules step N+1 while step N runs (vllm/v1/engine/core.py
    # step_with_batch_queue). The scheduler and query issuers assume the opposite (a load state's
    # name is unlinked at the next build_connector_meta, which may run before step N's workers
    # attached to it). The explicit choice stands, but it must not pass unnoticed.
    def settings(issuer: str, async_scheduling):
        cfg = vllm_config("127.0.0.1:1", uid, "tiny", "layerwise",
                          **{"pegaflow.load_issuer": issuer, "pegaflow.staging_blocks": 4})
        cfg.scheduler_config.async_scheduling = async_scheduling
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pegaflow.connector.vllm"):
            assert ConnectorSettings.from_vllm(cfg, env={}).load_issuer == issuer
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    for issuer in ("scheduler", "query"):
        warned = settings(issuer, True)
        assert any(issuer in m and "async_scheduling" in m and "--no-async-scheduling" in m for m in warned), warned
        assert settings(issuer, False) == []
    assert settings("worker", True) == []


def test_hybrid_kv_cache_groups_and_context_parallelism_are_refused_at_construction(uid):
    # vllm/v1/kv_cache_interface.py KVCacheConfig.kv_cache_groups: a hybrid model (sliding window +
    # full attention) has one block table per group; vllm/config/parallel.py
    # decode_context_parallel_size splits a block's KV over ranks. Neither can be stored per
    # (block id, layer) of group 0: refused by name, before any client or registration exists.
    from pegaflow.connector.vllm_api import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    cfg = vllm_config("127.0.0.1:1", uid, "tiny-" + uid, "layerwise")
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    two = KVCacheConfig(num_blocks=8, kv_cache_groups=[
        KVCacheGroupSpec(["l.0", "l.2"], spec), KVCacheGroupSpec(["l.1"], spec),
    ])
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=r"one KV cache group; this model has 2 .*\[2, 1\]"):
            PegaflowConnector(cfg, role, two)
    one = KVCacheConfig(num_blocks=8, kv_cache_groups=[KVCacheGroupSpec(["l.0"], spec)])
    one.needs_kv_cache_zeroing = True  # vLLM's property for a Mamba group
    with pytest.raises(ValueError, match="needs zeroing of new blocks"):
        PegaflowConnector(cfg, KVConnectorRole.SCHEDULER, one)
    cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="decode_context_parallel_size=2"):
        PegaflowConnector(cfg, KVConnectorRole.SCHEDULER, None)
