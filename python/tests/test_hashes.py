"""The Python chained block hashes equal lib/client/hashes.ts, checked on the
shared vectors (tests/vectors/block_hashes.json, generated from the
TypeScript implementation and checked against it by
tests/client/hash_vectors_test.ts)."""

from __future__ import annotations

import json
import os

import pytest

from pegaflow.hashes import BLOCK_HASH_BYTES, chained_block_hashes, synthetic_tokens

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
