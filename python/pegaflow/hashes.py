"""Chained prefix block hashes, byte-equal to lib/client/hashes.ts: block
i's hash is sha256(hash of block i-1 || block i's tokens as little-endian
u32)[:16], starting from sha256("pegaflow-root:" + salt)[:16]. Equal hashes
mean equal prefixes; no per-process seed, so they agree across processes,
ranks and restarts. (A vLLM engine passes its own `request.block_hashes`;
these are for our own engines and the cross-language test vectors.)
"""

from __future__ import annotations

import array
import hashlib
import numbers
import sys
from typing import List, Sequence

from pegaflow.native import chain_hashes_native

#: Bytes kept of each sha256 (lib/client/hashes.ts BLOCK_HASH_BYTES).
BLOCK_HASH_BYTES = 16
#: Llama-3 vocabulary size, the range of `synthetic_tokens`.
SYNTHETIC_VOCAB = 128_256
_U32 = 0xFFFFFFFF
#: The array typecode of a 4-byte unsigned int (C `unsigned int` on every LP64 host; else long).
_U32_CODE = "I" if array.array("I").itemsize == 4 else "L"


def root_hash(salt: str = "") -> bytes:
    """The parent of block 0."""
    return hashlib.sha256(f"pegaflow-root:{salt}".encode()).digest()[:BLOCK_HASH_BYTES]


def chained_block_hashes(tokens: Sequence[int], block_tokens: int, salt: str = "") -> List[bytes]:
    """Hashes of every full block of `tokens` (a trailing partial block gets none).

    Example:
        hs = chained_block_hashes(list(range(64)), 16)   # 4 hashes of 16 bytes
    """
    return chain_hashes(root_hash(salt), tokens, block_tokens)


def chain_hashes(parent: bytes, tokens: Sequence[int], block_tokens: int) -> List[bytes]:
    """The chain continued from `parent` over every full block of `tokens`
    (an engine extends a request's hashes as its blocks fill). libpegaflow
    computes it in one call where it is loaded (pegaflow.native), else hashlib
    does, byte-equal. A token id outside u32 raises ValueError.

    Example:
        hs = chained_block_hashes(list(range(64)), 16)
        assert chain_hashes(hs[1], list(range(32, 64)), 16) == hs[2:]
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    # Any bytes-like parent (a bytearray, a memoryview of a hash): libpegaflow's ctypes
    # signature takes only bytes, and hashlib's `prev + block` no memoryview.
    parent = bytes(memoryview(parent))
    if len(parent) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent hash is {len(parent)} bytes, expected {BLOCK_HASH_BYTES}")
    n = len(tokens) // block_tokens
    if n == 0:
        return []
    toks = u32_tokens(tokens[: n * block_tokens])
    out = chain_hashes_native(parent, toks, block_tokens, BLOCK_HASH_BYTES)
    if out is not None:
        return out
    le = toks.tobytes()
    out = []
    prev = parent
    step = block_tokens * 4
    sha = hashlib.sha256
    for o in range(0, len(le), step):
        prev = sha(prev + le[o : o + step]).digest()[:BLOCK_HASH_BYTES]
        out.append(prev)
    return out


def u32_tokens(tokens: Sequence[int]) -> array.array:
    """Token ids as a little-endian u32 array (the bytes each block hashes); an id
    outside u32 raises ValueError naming it."""
    try:
        a = array.array(_U32_CODE, tokens)
        if sys.byteorder == "big":
            a.byteswap()
        return a
    except (OverflowError, TypeError) as e:
        # Integral, not int: numpy's integers are token ids too (naming the first of them, a
        # valid one, sent the reader after the wrong token).
        at, bad = next(
            ((i, t) for i, t in enumerate(tokens) if not (isinstance(t, numbers.Integral) and 0 <= t <= _U32)),
            (None, None),
        )
        raise ValueError(f"block hashes: token id {bad!r} is not a u32 (position {at}: {e})") from None


def synthetic_tokens(seed: int, count: int) -> List[int]:
    """The deterministic token sequence lib/client/hashes.ts `syntheticTokens`
    makes for `seed` (xorshift32; the seed is spread as JavaScript does:
    a double multiplication, then ToUint32)."""
    x = int(float(seed * 2654435761)) % (1 << 32) or 1
    out = []
    for _ in range(count):
        x = (x ^ (x << 13)) & _U32
        x ^= x >> 17
        x = (x ^ (x << 5)) & _U32
        out.append(x % SYNTHETIC_VOCAB)
    return out
