"""The client over a Unix socket ("unix:/path"), against a server started
with --uds (skipped where this checkout's server has no --uds flag)."""

from __future__ import annotations

import os
import tempfile

import pytest

from pegaflow.client import PegaflowClient
from pegaflow.load_state import LoadState

from kv_helpers import fill, make_kv, matches, register
from server_proc import ServerProc, server_has_flag

pytestmark = pytest.mark.skipif(not server_has_flag("--uds"), reason="this server has no --uds listener")


def test_save_query_load_work_over_a_unix_socket(uid):
    d = tempfile.mkdtemp(prefix="pf-uds-")
    sock = os.path.join(d, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    region, kv = make_kv(2, 16)
    c = PegaflowClient("unix:" + sock)
    try:
        assert s.uds == sock
        assert c.health().status == "ok"
        reg = register(c, kv, uid, "ns-" + uid)
        hashes = [bytes([i]) * 16 for i in range(1, 4)]
        fill(kv, [1, 2, 3], hashes)
        assert c.save(instance_id=uid, tp_rank=0, block_ids=[1, 2, 3], block_hashes=hashes).blocks_saved == 3
        q = c.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="r")
        with LoadState.create() as st:
            c.load(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=[7, 8, 9], load_state_shm=st.name)
            st.wait_all(timeout_s=30)
        assert matches(kv, [7, 8, 9], hashes) == []
        reg.close()
    finally:
        c.close()
        region.close()
        s.stop()
        if os.path.exists(sock):
            os.unlink(sock)
        os.rmdir(d)
