"""The client's own wire bytes for block hashes (`_hashes_field`): equal to what protobuf
serializes, every shape it does not cover is left to the message, and any iterable of hashes
works against a real server."""

from __future__ import annotations

import array
import os

import pytest

from pegaflow._proto import pegaflow_pb2 as pb
from pegaflow.client import _hashes_field


@pytest.mark.parametrize("message", ["QueryPrefetchRequest", "SaveRequest"])
@pytest.mark.parametrize("n,size", [(1, 16), (639, 16), (3, 32), (2, 1), (4, 127)])
def test_joined_hashes_are_the_bytes_protobuf_writes_and_parse_back_merged(message, n, size):
    hashes = [os.urandom(size) for _ in range(n)]
    want = getattr(pb, message)(block_hashes=hashes).SerializeToString()
    assert _hashes_field(message, hashes) == want
    head = getattr(pb, message)(instance_id="i", request_id="r")
    merged = getattr(pb, message).FromString(head.SerializeToString() + _hashes_field(message, hashes))
    assert (list(merged.block_hashes), merged.instance_id, merged.request_id) == (hashes, "i", "r")


def test_bytes_like_hashes_are_taken_without_copies():
    hs = [bytearray(b"\x01" * 16), memoryview(b"\x02" * 16), b"\x03" * 16]
    parsed = pb.QueryPrefetchRequest.FromString(_hashes_field("QueryPrefetchRequest", hs))
    assert list(parsed.block_hashes) == [b"\x01" * 16, b"\x02" * 16, b"\x03" * 16]


@pytest.mark.parametrize(
    "hashes",
    [
        [b"\x01" * 16, b"\x02" * 15],
        [b"\x01" * 128],
        [b""],
        ["ab"],
        [16],
        [array.array("I", range(4))],
        [memoryview(array.array("Q", range(2)))],
    ],
    ids=["mixed lengths", "a 2-byte length", "empty hash", "str", "int", "u32 array", "u64 view"],
)
def test_shapes_it_does_not_cover_are_left_to_the_message(hashes):
    assert _hashes_field("QueryPrefetchRequest", hashes) is None


def test_no_hashes_is_an_empty_field():
    assert _hashes_field("SaveRequest", []) == b""


def test_a_save_and_a_query_take_hashes_from_any_iterable(client, uid):
    """A generator is read once, whichever way its hashes go on the wire."""
    from kv_helpers import fill, make_kv, register

    region, kv = make_kv(2, 8)
    reg = register(client, kv, uid, "ns-" + uid)
    try:
        hashes = [bytes([i]) * 16 for i in range(1, 4)]
        fill(kv, [1, 2, 3], hashes)
        r = client.save(instance_id=uid, tp_rank=0, block_ids=[1, 2, 3], block_hashes=(h for h in hashes))
        assert r.blocks_saved == 3
        q = client.query_prefetch(instance_id=uid, block_hashes=iter(hashes), request_id="r-gen")
        assert q.hits == 3
        client.release(q.lease_id)
    finally:
        reg.close()
        region.close()
