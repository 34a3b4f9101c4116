"""WaitPrefetch through the Python client against a real server with an SSD tier: after a
"loading" answer the blocking call (local RPC socket) and the nowait one (gRPC) are answered
once the read ended, and the next query hits every block, loaded byte-equal; bad input is
refused before it is sent (wait_ms) or by the server (naming the instance)."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import grpc
import pytest

from pegaflow.client import MAX_PREFETCH_WAIT_MS, PegaflowClient
from pegaflow.errors import PegaflowError
from pegaflow.load_state import LoadState

from kv_helpers import fill, make_kv, matches, register
from server_proc import ServerProc
from waits import wait_for

BLOCKS = 6
#: Far above a 6-block read on a loaded CI machine: an answer before it is the read's end.
WAIT_MS = 15000


def _evicted_to_ssd(s: ServerProc, n: int) -> None:
    """Waits for `n` blocks written behind, then drops every block from the server's RAM."""
    wait_for(lambda: s.metric("pegaflow_ssd_write_blocks_total") >= n, "the blocks written behind to SSD", 30)
    assert s.post("/cache/memory/cleanup") == 200


def test_wait_prefetch_is_answered_when_the_ssd_read_ends_over_both_transports(uid):
    d = tempfile.mkdtemp(prefix="pf-wait-")
    sock = os.path.join(d, "pf.sock")
    s = ServerProc.start(extra=[
        "--uds", sock, "--http-addr", "127.0.0.1:0", "--ssd-cache-path", d, "--ssd-cache-capacity", "128mb",
        "--ssd-segment-size", "4mb",
    ])
    region, kv = make_kv(2, 32)
    local = PegaflowClient("unix:" + sock)
    tcp = PegaflowClient(s.addr)
    try:
        reg = register(tcp, kv, uid, "ns-" + uid)
        hashes = [bytes([i]) * 16 for i in range(1, BLOCKS + 1)]
        src = list(range(1, BLOCKS + 1))
        fill(kv, src, hashes)
        assert tcp.save(instance_id=uid, tp_rank=0, block_ids=src, block_hashes=hashes).blocks_saved == BLOCKS

        def round_trip(client: PegaflowClient, rid: str, nowait: bool) -> None:
            _evicted_to_ssd(s, BLOCKS)
            assert client.query_prefetch(instance_id=uid, block_hashes=hashes, request_id=rid).loading
            t0 = time.monotonic()
            if nowait:
                got: list = []
                done = threading.Event()
                client.wait_prefetch_nowait(
                    instance_id=uid, request_id=rid, wait_ms=WAIT_MS,
                    on_done=lambda settled, err: (got.append((settled, err)), done.set()),
                )
                assert done.wait(WAIT_MS / 1000 + 30), "no answer to the nowait wait"
                assert got == [(True, None)]
            else:
                assert client.wait_prefetch(instance_id=uid, request_id=rid, wait_ms=WAIT_MS) is True
            assert time.monotonic() - t0 < WAIT_MS / 1000, f"{rid}: answered at the read's end, not the hold's"
            q = client.query_prefetch(instance_id=uid, block_hashes=hashes, request_id=rid)
            assert not q.loading and q.hits == BLOCKS, f"{rid}: the query after the wait hits from RAM"
            dst = list(range(16, 16 + BLOCKS))
            for name in kv:
                kv[name][:, dst] = 0
            with LoadState.create() as st:
                client.load(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=dst, load_state_shm=st.name)
                st.wait_all(timeout_s=30)
            assert matches(kv, dst, hashes) == []

        round_trip(local, "over-local-rpc", nowait=False)
        round_trip(tcp, "over-grpc", nowait=True)
        assert local._local is not None and local._local.calls >= 3, "the local client used its socket"
        assert s.metric("pegaflow_ssd_read_blocks_total") == 2 * BLOCKS
        reg.close()
    finally:
        local.close()
        tcp.close()
        region.close()
        s.stop()


def test_wait_prefetch_bad_input_is_refused_naming_what_was_wrong(server, uid):
    c = PegaflowClient(server.addr)
    try:
        for bad in (0, MAX_PREFETCH_WAIT_MS + 1, 1.5):
            with pytest.raises(ValueError, match=r"wait_ms must be 1\.\.60000"):
                c.wait_prefetch(instance_id=uid, request_id="r", wait_ms=bad)
        with pytest.raises(PegaflowError) as e:
            c.wait_prefetch(instance_id="nobody-" + uid, request_id="r", wait_ms=10)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f'WaitPrefetch (request "r"): instance "nobody-{uid}" is not registered' in e.value.details
    finally:
        c.close()
