"""Host-backend KV caches for the tests: every layer a KV-first
`[2, num_blocks, block_tokens, heads, head_dim]` view into ONE shm region
(as vLLM carves layers out of one allocation), and deterministic block
contents derived from (block hash, layer, K/V)."""

from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Sequence, Tuple

import numpy as np

from pegaflow.client import PegaflowClient
from pegaflow.regions import ShmRegion, export_kv_layers
from pegaflow.registration import KvRegistration

SHAPE = dict(block_tokens=4, heads=2, head_dim=8)


def make_kv(num_layers: int, num_blocks: int, prefix: str = "model.layers") -> Tuple[ShmRegion, Dict[str, np.ndarray]]:
    bt, h, d = SHAPE["block_tokens"], SHAPE["heads"], SHAPE["head_dim"]
    per_layer = 2 * num_blocks * bt * h * d * 2  # float16
    region = ShmRegion(per_layer * num_layers)
    kv = {
        f"{prefix}.{i}.self_attn.attn": region.numpy(np.float16, (2, num_blocks, bt, h, d), offset=i * per_layer)
        for i in range(num_layers)
    }
    return region, kv


def block_content(h: bytes, layer: int, seg: int) -> np.ndarray:
    bt, hh, d = SHAPE["block_tokens"], SHAPE["heads"], SHAPE["head_dim"]
    seed = hashlib.sha256(h + bytes([layer, seg])).digest()
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    return rng.standard_normal((bt, hh, d)).astype(np.float16)


def fill(kv: Dict[str, np.ndarray], block_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
    for li, t in enumerate(kv.values()):
        for b, h in zip(block_ids, hashes):
            for s in range(2):
                t[s, b] = block_content(h, li, s)


def save_one(client: PegaflowClient, kv: Dict[str, np.ndarray], instance_id: str, block_id: int, mark: int) -> int:
    """Fills `block_id` with the content of hash `bytes([mark]) * 16` and saves it: the blocks
    saved (a registered rank of `instance_id` answers 1)."""
    hashes = [bytes([mark]) * 16]
    fill(kv, [block_id], hashes)
    return client.save(instance_id=instance_id, tp_rank=0, block_ids=[block_id], block_hashes=hashes).blocks_saved


def matches(kv: Dict[str, np.ndarray], block_ids: Sequence[int], hashes: Sequence[bytes]) -> List[Tuple[str, int, int]]:
    """(layer, block, seg) triples whose bytes differ from the expected content."""
    bad = []
    for li, (name, t) in enumerate(kv.items()):
        for b, h in zip(block_ids, hashes):
            for s in range(2):
                if t[s, b].tobytes() != block_content(h, li, s).tobytes():
                    bad.append((name, b, s))
    return bad


def register(client: PegaflowClient, kv, instance_id: str, namespace: str, **kw) -> KvRegistration:
    layers, device = export_kv_layers(kv)
    reg = KvRegistration(client, instance_id=instance_id, namespace=namespace, layers=layers, device_id=device, **kw)
    reg.register()
    return reg


def my_states() -> List[str]:
    """This process's load-state files in /dev/shm (a test's leak check)."""
    mark = f"pegaflow-ls-{os.getpid()}-"
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(mark))
