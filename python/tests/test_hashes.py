"""The Python chained block hashes equal lib/client/hashes.ts, checked on the
shared vectors (tests/vectors/block_hashes.json, generated from the
TypeScript implementation and checked against it by
tests/client/hash_vectors_test.ts), and libpegaflow's native chain (SHA
extensions and portable C) equals hashlib's."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys

import pytest

from pegaflow import hashes as hashes_mod
from pegaflow import native
from pegaflow.hashes import (
    BLOCK_HASH_BYTES,
    chain_hashes,
    chained_block_hashes,
    root_hash,
    synthetic_tokens,
)

VECTORS = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "vectors", "block_hashes.json")
CASES = json.load(open(VECTORS))["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_python_chained_hashes_match_the_typescript_vectors(case):
    got = [h.hex() for h in chained_block_hashes(case["tokens"], case["blockTokens"], case["salt"])]
    assert got == case["hashes"]
    assert all(len(bytes.fromhex(h)) == BLOCK_HASH_BYTES for h in got)


@pytest.mark.parametrize("case", [c for c in CASES if "synthetic" in c], ids=lambda c: c["name"])
def test_python_synthetic_tokens_match_the_typescript_vectors(case):
    assert synthetic_tokens(case["synthetic"]["seed"], case["synthetic"]["count"]) == case["tokens"]


def test_a_changed_token_changes_its_block_and_every_later_hash():
    a = chained_block_hashes(list(range(32)), 8)
    t = list(range(32))
    t[9] = 1000
    b = chained_block_hashes(t, 8)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))


# ---- the native chain (libpegaflow's pf_chain_hashes) against hashlib -------------------------

def _reference_chain(parent: bytes, tokens, block_tokens: int):
    """The formula written out with hashlib alone (what hashes.py's docstring states)."""
    out, prev = [], parent
    for b in range(len(tokens) // block_tokens):
        blk = tokens[b * block_tokens:(b + 1) * block_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(blk)}I", *blk)).digest()[:BLOCK_HASH_BYTES]
        out.append(prev)
    return out


def test_the_native_chain_is_loaded_where_the_library_is_built():
    # `make test` builds build/libpegaflow.so first; a silent fallback would hide a slow engine.
    assert native.hash_impl() in ("sha-ni", "portable")


@pytest.mark.parametrize("block_tokens", [1, 4, 11, 12, 16, 17, 32, 100])
def test_the_native_chain_equals_hashlib_across_sha256_padding_boundaries(block_tokens):
    # 16-byte parent + 4*block_tokens bytes: 20..416-byte messages, across every padding case
    # (one block, the length spilling into a second, several whole blocks).
    rng = random.Random(block_tokens)
    tokens = [rng.randrange(1 << 32) for _ in range(block_tokens * 9 + 3)]
    parent = root_hash("pad")
    want = _reference_chain(parent, tokens, block_tokens)
    assert chain_hashes(parent, tokens, block_tokens) == want
    assert len(want) == len(tokens) // block_tokens >= 9


def test_the_portable_compression_equals_the_sha_extensions():
    # PF_SHA256=portable makes the library skip the SHA extensions at load: a child process
    # computes the shared vectors with the C rounds and must agree with this one.
    code = (
        "import json,sys;from pegaflow import native;from pegaflow.hashes import chained_block_hashes as c;"
        "cases=json.load(open(sys.argv[1]))['cases'];"
        "print(native.hash_impl());"
        "print(json.dumps([[h.hex() for h in c(k['tokens'],k['blockTokens'],k['salt'])] for k in cases]))"
    )
    env = {**os.environ, "PF_SHA256": "portable"}
    r = subprocess.run([sys.executable, "-c", code, VECTORS], env=env, capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr
    impl, got = r.stdout.splitlines()
    assert impl == "portable"
    assert json.loads(got) == [c["hashes"] for c in CASES]


def test_both_paths_continue_a_chain_from_any_block(monkeypatch):
    tokens = list(range(1000, 1000 + 16 * 6))
    full = chained_block_hashes(tokens, 16, "c")
    assert chain_hashes(full[2], tokens[48:], 16) == full[3:]
    monkeypatch.setattr(hashes_mod, "chain_hashes_native", lambda *a: None)  # the hashlib path
    assert chained_block_hashes(tokens, 16, "c") == full
    assert chain_hashes(full[2], tokens[48:], 16) == full[3:]


@pytest.mark.parametrize("path", ["native", "hashlib"])
@pytest.mark.parametrize("bad", [-1, 1 << 32, 2.5])
def test_a_token_id_outside_u32_is_refused_by_name_on_either_path(monkeypatch, path, bad):
    if path == "hashlib":
        monkeypatch.setattr(hashes_mod, "chain_hashes_native", lambda *a: None)
    with pytest.raises(ValueError, match=f"token id {bad!r} is not a u32"):
        chained_block_hashes([1, 2, bad, 4], 2)


def test_a_wrong_parent_or_block_size_is_refused():
    with pytest.raises(ValueError, match="parent hash is 3 bytes, expected 16"):
        chain_hashes(b"abc", [1, 2], 1)
    with pytest.raises(ValueError, match="block_tokens must be >= 1, got 0"):
        chain_hashes(root_hash(), [1, 2], 0)
