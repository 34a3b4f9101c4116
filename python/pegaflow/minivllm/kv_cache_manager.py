"""The paged KV cache's bookkeeping: a block pool with ref counts and a hash → block prefix cache.

Mirrors vLLM's `vllm/v1/core/block_pool.py` and `kv_cache_manager.py` for one full-attention
KV cache group. Invariants:
- block 0 is the null block: never handed out, never freed, never cached;
- a block with `ref_cnt == 0` sits in the free queue (LRU order: head is evicted first) and
  may still be in the prefix cache until it is handed out again;
- a block is in the prefix cache only while it is full and its hash is the request's hash of
  that block position; handing a cached free block out evicts it from the cache first.

Example:
    >>> from pegaflow.minivllm.request import Request
    >>> m = KVCacheManager(num_blocks=8, block_size=4)
    >>> r = Request("a", list(range(10)), block_size=4)
    >>> m.allocate_slots(r, 10).get_block_ids()
    ([1, 2, 3],)
"""

from __future__ import annotations

from collections import OrderedDict

from pegaflow.connector.vllm_api import KVCacheBlock, KVCacheBlocks
from pegaflow.minivllm.request import Request

__all__ = ["BlockPool", "KVCacheManager"]


class BlockPool:
    """Physical blocks, their ref counts, the free queue and the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1  # never reaches the free queue
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self._free):
            raise ValueError(f"cannot get {num_blocks} free blocks: {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, blk = self._free.popitem(last=False)
            self._maybe_evict_cached_block(blk)
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits (removing free ones from the free queue)."""
        for blk in blocks:
            if blk.ref_cnt == 0 and not blk.is_null:
                del self._free[blk.block_id]
            blk.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching 0 go to the free queue's tail in the given order."""
        for blk in ordered_blocks:
            if blk.is_null:
                continue
            assert blk.ref_cnt > 0, f"double free of block {blk.block_id}"
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = blk

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Publish blocks [num_cached_blocks, num_full_blocks) under the request's hashes."""
        if not self.enable_caching:
            return
        assert num_full_blocks <= len(request.block_hashes), (
            f"request {request.request_id}: caching {num_full_blocks} blocks, "
            f"only {len(request.block_hashes)} hashes"
        )
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.block_hash is not None:  # a prefix-cache hit: already published
                continue
            h = request.block_hashes[i]
            blk.block_hash = h
            # A duplicate (same content computed twice) keeps the first block in the map.
            self.cached_block_hash_to_block.setdefault(h, blk)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Remove these blocks from the prefix cache (their content is not to be trusted)."""
        for bid in block_ids:
            self._maybe_evict_cached_block(self.blocks[bid])

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is still in use."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for blk in self.blocks:
            blk.block_hash = None
        return True

    def _maybe_evict_cached_block(self, blk: KVCacheBlock) -> None:
        h = blk.block_hash
        if h is None:
            return
        blk.block_hash = None
        if self.cached_block_hash_to_block.get(h) is blk:
            del self.cached_block_hash_to_block[h]


class KVCacheManager:
    """Per-request block tables over a `BlockPool` (vLLM's `KVCacheManager`, one group)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(([],))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest run of the request's leading blocks in the prefix cache, and its token count.

        The last prompt token is always recomputed (its logits give the next token), so a
        hit never covers the whole request.
        """
        if not self.enable_caching:
            return self.empty_blocks(), 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            blk = self.block_pool.get_cached_block(h)
            if blk is None:
                break
            hits.append(blk)
        return KVCacheBlocks((hits,)), len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Give the request slots for its computed + new tokens; None when blocks run out.

        Returns the newly allocated blocks (not the prefix hits). Full blocks are published
        to the prefix cache now unless `delay_cache_blocks` (an async load fills them later).
        """
        computed = list(new_computed_blocks.blocks[0]) if new_computed_blocks else []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local_computed + num_external_computed_tokens
        need_slots = total_computed + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            need_slots = min(need_slots, self.max_model_len)
        num_required = -(-need_slots // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(computed))
        # Hits that sit in the free queue stop being free once touched.
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(computed)
        req_blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return KVCacheBlocks((new_blocks,))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full)
        self.num_cached_block[request.request_id] = num_full

    def uncache_from(self, request_id: str, first_block: int) -> None:
        """The request's blocks from `first_block` on are to be recomputed (evicted after a failed
        load): publish them again once they are, instead of counting them as published."""
        if self.num_cached_block.get(request_id, 0) > first_block:
            self.num_cached_block[request_id] = first_block

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so a prompt's last blocks evict first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks((list(self.req_to_blocks.get(request_id, [])),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return ([b.block_id for b in self.req_to_blocks.get(request_id, [])],)
