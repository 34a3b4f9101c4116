"""Every RPC of the Python client against a real host-backend server, and
how failures surface (PegaflowError with the gRPC code and the server's message)."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from pegaflow.client import PROTOCOL_VERSION, Geometry, PegaflowClient
from pegaflow.config import ClientConfig, check_address
from pegaflow.errors import PegaflowError
from pegaflow.hashes import chained_block_hashes, synthetic_tokens
from pegaflow.load_state import LoadState
from pegaflow.regions import export_kv_layers

from kv_helpers import fill, make_kv, matches, register


def test_health_reports_protocol_version_and_host_backend(client):
    h = client.health()
    assert (h.status, h.version, h.backend) == ("ok", PROTOCOL_VERSION, "host")


def test_save_query_load_round_trip_lands_byte_exact_in_other_blocks(client, uid):
    region, kv = make_kv(3, 32)
    reg = register(client, kv, uid, "ns-" + uid)
    try:
        hashes = chained_block_hashes(synthetic_tokens(7, 5 * 4), 4, salt=uid)
        src = [3, 4, 5, 6, 7]
        fill(kv, src, hashes)
        r = client.save(instance_id=uid, tp_rank=0, block_ids=src, block_hashes=hashes, request_id="r1")
        assert (r.blocks_saved, r.blocks_skipped, r.blocks_refused) == (5, 0, 0)
        assert r.bytes_copied == 5 * 3 * 2 * 4 * 2 * 8 * 2
        again = client.save(instance_id=uid, tp_rank=0, block_ids=src, block_hashes=hashes)
        assert (again.blocks_saved, again.blocks_skipped) == (0, 5)

        q = client.query_prefetch(instance_id=uid, block_hashes=hashes + [b"\x01" * 16], request_id="r2")
        assert not q.loading and q.hits == 5 and len(q.lease_id) == 16 and q.ttl_ms > 0
        dst = [20, 21, 25, 26, 30]
        with LoadState.create() as st:
            res = client.load(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=dst, load_state_shm=st.name)
            assert (res.num_blocks, res.num_layers) == (5, 3)
            st.wait_all(timeout_s=30)
            assert st.snapshot().layers_ready == 3
        assert matches(kv, dst, hashes) == []
    finally:
        reg.close()
        region.close()


def test_a_whole_load_into_descending_blocks_lands_byte_exact(client, uid):
    """`whole=True` (an async engine's load): the same contract, the server free to use copy lanes."""
    region, kv = make_kv(2, 32)
    reg = register(client, kv, uid, "ns-" + uid)
    try:
        hashes = chained_block_hashes(synthetic_tokens(17, 4 * 4), 4, salt=uid)
        fill(kv, [0, 1, 2, 3], hashes)
        client.save(instance_id=uid, tp_rank=0, block_ids=[0, 1, 2, 3], block_hashes=hashes)
        q = client.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="w1")
        assert q.hits == 4
        dst = [31, 30, 29, 28]
        with LoadState.create() as st:
            res = client.load(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=dst,
                              load_state_shm=st.name, request_id="w1", whole=True)
            assert (res.num_blocks, res.num_layers) == (4, 2)
            st.wait_all(timeout_s=30)
        assert matches(kv, dst, hashes) == []
    finally:
        reg.close()
        region.close()


def test_a_lease_is_consumed_once_per_rank_and_release_gives_it_back(client, uid):
    region, kv = make_kv(1, 16)
    reg = register(client, kv, uid, "ns-" + uid)
    try:
        hashes = chained_block_hashes(synthetic_tokens(1, 8), 4, salt=uid)
        fill(kv, [0, 1], hashes)
        client.save(instance_id=uid, tp_rank=0, block_ids=[0, 1], block_hashes=hashes)
        q = client.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="a")
        with LoadState.create() as st:
            client.load(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=[5, 6], load_state_shm=st.name)
            st.wait_all(timeout_s=30)
            st.rearm()
            with pytest.raises(PegaflowError) as e:
                client.load(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=[7, 8], load_state_shm=st.name)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.method == "Load"
            assert st.state < 0  # a refused load is visible to a poller too
        q2 = client.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="b")
        client.release(q2.lease_id)
        with LoadState.create() as st, pytest.raises(PegaflowError) as e:
            client.load(instance_id=uid, tp_rank=0, lease_id=q2.lease_id, block_ids=[7, 8], load_state_shm=st.name)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        reg.close()
        region.close()


def test_a_miss_answers_zero_hits_and_no_lease(client, uid):
    region, kv = make_kv(1, 8)
    reg = register(client, kv, uid, "ns-" + uid)
    try:
        q = client.query_prefetch(instance_id=uid, block_hashes=[b"\x07" * 16], request_id="m")
        assert (q.loading, q.hits, q.lease_id) == (False, 0, b"")
    finally:
        reg.close()
        region.close()


def test_errors_carry_the_grpc_code_the_method_and_the_servers_message(client, uid):
    with pytest.raises(PegaflowError) as e:
        client.query_prefetch(instance_id="nobody-" + uid, block_hashes=[b"x"], request_id="q")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.method == "QueryPrefetch" and "nobody-" + uid in e.value.details
    with pytest.raises(PegaflowError) as e:
        client.release(b"short")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "16" in e.value.details
    with pytest.raises(PegaflowError) as e:
        client.unregister_context("nobody-" + uid)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_register_refuses_bad_geometry_and_a_second_registration_of_a_rank(client, uid):
    region, kv = make_kv(2, 8)
    layers, _ = export_kv_layers(kv)
    try:
        bad = Geometry(8, 512, 4096, 512, 2, 0, 16)  # reaches far past a 16-byte region
        with pytest.raises(PegaflowError) as e:
            client.register_context(
                instance_id=uid, namespace="ns-" + uid, tp_rank=0, tp_size=1,
                layer_names=["l0"], region_handles=[layers[0].handle], geometry=[bad],
            )
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "region" in e.value.details
        with pytest.raises(PegaflowError) as e:
            client.register_context(
                instance_id=uid, namespace="ns-" + uid, tp_rank=0, tp_size=1,
                layer_names=[l.name for l in layers], region_handles=[l.handle for l in layers],
                geometry=[l.geometry for l in layers], client_version="pegaflow-0",
            )
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "pegaflow-0" in e.value.details
        reg = register(client, kv, uid, "ns-" + uid)
        with pytest.raises(PegaflowError) as e:
            reg._register_once()
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        reg.close()
    finally:
        region.close()


def test_save_with_a_block_id_out_of_range_is_invalid_argument(client, uid):
    region, kv = make_kv(1, 8)
    reg = register(client, kv, uid, "ns-" + uid)
    try:
        with pytest.raises(PegaflowError) as e:
            client.save(instance_id=uid, tp_rank=0, block_ids=[8], block_hashes=[b"\x01" * 16])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "8" in e.value.details
    finally:
        reg.close()
        region.close()


def test_unregister_releases_leases_and_ends_the_session_with_cleaned_up(client, uid):
    region, kv = make_kv(1, 8)
    layers, _ = export_kv_layers(kv)
    try:
        client.register_context(
            instance_id=uid, namespace="ns-" + uid, tp_rank=0, tp_size=1,
            layer_names=[l.name for l in layers], region_handles=[l.handle for l in layers],
            geometry=[l.geometry for l in layers],
        )
        s = client.open_session(uid)
        hashes = [b"\x05" * 16]
        client.save(instance_id=uid, tp_rank=0, block_ids=[1], block_hashes=hashes)
        client.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="u")
        assert client.unregister_context(uid) == 1
        ev = s.next_event()
        assert ev is not None and ev.kind == ev.CLEANED_UP
        assert s.next_event() is None
    finally:
        region.close()


def test_a_dead_address_fails_fast_with_unavailable_not_a_hang(uid):
    c = PegaflowClient("127.0.0.1:1", rpc_timeout_ms=20_000)
    t0 = time.monotonic()
    with pytest.raises(PegaflowError) as e:
        c.health()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 15  # failed on its own, well before the deadline
    c.close()


def test_a_peer_that_never_speaks_grpc_ends_the_call_at_its_deadline(uid):
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)  # accepts TCP, never speaks HTTP/2
    try:
        c = PegaflowClient(f"127.0.0.1:{srv.getsockname()[1]}", rpc_timeout_ms=300)
        with pytest.raises(PegaflowError) as e:
            c.health()
        # gRPC reports the handshake that never finished as UNAVAILABLE, a stalled call as
        # DEADLINE_EXCEEDED; either way the call ended by its own deadline.
        assert e.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        assert e.value.method == "Health"
        c.close()
    finally:
        srv.close()


def test_config_reads_env_and_refuses_bad_values():
    cfg = ClientConfig.resolve(env={"PEGAFLOW_ADDR": "unix:/run/pf.sock", "PEGAFLOW_RPC_TIMEOUT_MS": "250"})
    assert (cfg.addr, cfg.rpc_timeout_s) == ("unix:/run/pf.sock", 0.25)
    assert ClientConfig.resolve(addr="10.0.0.1:9", env={"PEGAFLOW_ADDR": "x:1"}).addr == "10.0.0.1:9"
    with pytest.raises(ValueError, match="PEGAFLOW_SAVE_TIMEOUT_MS"):
        ClientConfig.resolve(env={"PEGAFLOW_SAVE_TIMEOUT_MS": "soon"})
    for bad in ("localhost", "unix:relative", "h:99999"):
        with pytest.raises(ValueError):
            check_address(bad)


def test_the_channel_is_made_again_in_a_forked_child(client):
    client.health()
    pid = os.fork()
    if pid == 0:
        try:
            ok = client.health().status == "ok"
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
