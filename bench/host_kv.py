"""One engine rank's KV for the Python benchmarks on a host-backend server: `layers` KV-first
`[2, blocks, block_tokens, kv_heads, head_dim]` float16 views into ONE shm region (as vLLM
carves layers out of one allocation), registered with the server.

    region, reg = register_host_kv(client, "inst", layers=32, blocks=640, block_tokens=16,
                                   kv_heads=8, head_dim=128)
    ...
    reg.close(); region.close()
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import numpy as np  # noqa: E402

from pegaflow.client import PegaflowClient  # noqa: E402
from pegaflow.regions import ShmRegion, export_kv_layers  # noqa: E402
from pegaflow.registration import KvRegistration  # noqa: E402


def register_host_kv(
    client: PegaflowClient, instance_id: str, *, layers: int, blocks: int, block_tokens: int, kv_heads: int,
    head_dim: int,
) -> tuple[ShmRegion, KvRegistration]:
    """The region and its registration (namespace "ns-" + instance_id, tp_rank 0)."""
    shape = (2, blocks, block_tokens, kv_heads, head_dim)
    per_layer = int(np.prod(shape)) * 2
    region = ShmRegion(per_layer * layers)
    kv = {
        f"model.layers.{i}.self_attn.attn": region.numpy(np.float16, shape, offset=i * per_layer)
        for i in range(layers)
    }
    regions, device = export_kv_layers(kv)
    reg = KvRegistration(
        client, instance_id=instance_id, namespace="ns-" + instance_id, layers=regions, device_id=device
    )
    try:
        reg.register()
    except BaseException:
        region.close()
        raise
    return region, reg
