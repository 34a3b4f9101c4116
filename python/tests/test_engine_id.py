"""One instance, one engine: every rank of a vLLM engine registers with the engine's
`kv_transfer_config.engine_id`, and the server refuses a rank of another engine under the
same instance id (FAILED_PRECONDITION "... is registered by another engine", naming both
engine ids) even when the instance has not registered that rank yet: before, a second engine
misconfigured with the same instance id became the first engine's missing rank, and the first
engine's loads were scattered into its memory."""

from __future__ import annotations

import json
import pickle
import time
import types

import grpc
import numpy as np
import pytest
import torch

from pegaflow.client import PegaflowClient
from pegaflow.connector.vllm import ConnectorSettings, PegaflowConnector
from pegaflow.connector.vllm_api import (
    CacheConfig,
    KVConnectorRole,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from pegaflow.errors import PegaflowError
from pegaflow.load_state import STATE_REJECTED, LoadState
from pegaflow.regions import export_kv_layers

from kv_helpers import fill, make_kv, matches, register
from tp_ranks import rank_content
from waits import wait_for


def close_all(conns, regions) -> None:
    """Shuts the connectors down, then closes their KV regions."""
    for c in conns:
        c.shutdown()
    for region, _ in regions:
        region.close()


def tp2_config(addr: str, instance: str, engine_id=None) -> VllmConfig:
    """One engine's config, TP 2 (`rank` set per worker). `engine_id` None: vLLM's default, a
    uuid4 made when the config is."""
    return VllmConfig(
        model_config=ModelConfig(model="tiny", dtype=torch.float16, num_layers=2, num_kv_heads=4, head_size=8),
        cache_config=CacheConfig(block_size=4),
        parallel_config=ParallelConfig(tensor_parallel_size=2),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PegaflowConnector", kv_role="kv_both", engine_id=engine_id,
            kv_connector_module_path="pegaflow.connector.vllm",
            kv_connector_extra_config={
                "pegaflow.addr": addr, "pegaflow.instance_id": instance, "pegaflow.namespace": "ns-" + instance,
                "pegaflow.mode": "async", "pegaflow.reconnect_max_ms": 200,
            },
        ),
    )


def worker(cfg: VllmConfig, rank: int) -> PegaflowConnector:
    """The worker-side connector of TP rank `rank`, built from the engine's config as vLLM
    ships it to that worker (pickled, its parallel rank set)."""
    mine = pickle.loads(pickle.dumps(cfg))
    mine.parallel_config.rank = rank
    return PegaflowConnector(mine, KVConnectorRole.WORKER, None)


def start_ranks(cfg: VllmConfig, regions: list, conns: list) -> list:
    """Builds rank i's worker connector over `regions[i]` for each region (appended to `conns`,
    so `close_all` shuts down whatever was built) and registers its KV; their registrations."""
    for rank, (_, kv) in enumerate(regions):
        conns.append(worker(cfg, rank))
        conns[-1].register_kv_caches(kv)
    return [c._w().registration for c in conns]


def registered(server, instance: str) -> list:
    """(tp_rank, engine_id) of every "rank registered" line the server logged for `instance`."""
    out = []
    for line in server.logs().splitlines():
        if '"rank registered"' in line:
            j = json.loads(line)
            if j["instance"] == instance:
                out.append((j["tp_rank"], j.get("engine_id")))
    return out


def round_trip(client: PegaflowClient, instance: str, kvs: list) -> list:
    """Saves block 1 of every rank (each rank's own bytes), loads it into block 6 of every rank and
    returns the (rank, layer, seg) that did not come back byte-exact (empty: it worked)."""
    h = b"\x5a" * 16
    for r, kv in enumerate(kvs):
        for li, t in enumerate(kv.values()):
            for s in range(2):
                t[s, 1] = rank_content(h, r, li, s)
        client.save(instance_id=instance, tp_rank=r, block_ids=[1], block_hashes=[h])
    q = client.query_prefetch(instance_id=instance, block_hashes=[h], request_id="rt-" + instance)
    assert not q.loading and q.hits == 1, q
    for r in range(len(kvs)):
        with LoadState.create() as st:
            client.load(instance_id=instance, tp_rank=r, lease_id=q.lease_id, block_ids=[6], load_state_shm=st.name)
            st.wait_all(timeout_s=30)
    return [
        (r, li, s)
        for r, kv in enumerate(kvs)
        for li, t in enumerate(kv.values())
        for s in range(2)
        if t[s, 6].tobytes() != rank_content(h, r, li, s).tobytes()
    ]


def test_every_rank_of_one_engine_registers_its_config_engine_id(server, client, uid):
    cfg = tp2_config(server.addr, uid)
    eid = cfg.kv_transfer_config.engine_id
    assert eid, "the config makes an engine id, as vLLM's does"
    regions, conns = [], []
    try:
        for rank in range(2):
            region, kv = make_kv(2, 8)
            regions.append((region, kv))
            conns.append(worker(cfg, rank))
            conns[-1].register_kv_caches(kv)
        assert all(c._w().registration.connected for c in conns)
        assert sorted(registered(server, uid)) == [(0, eid), (1, eid)]
        assert round_trip(client, uid, [kv for _, kv in regions]) == []
    finally:
        close_all(conns, regions)


def test_a_second_engine_with_another_engine_id_is_refused_naming_both_and_the_first_keeps_its_instance(
    server, client, uid
):
    first, second = tp2_config(server.addr, uid), tp2_config(server.addr, uid)
    a, b = first.kv_transfer_config.engine_id, second.kv_transfer_config.engine_id
    assert a != b
    regions = [make_kv(2, 8) for _ in range(3)]
    conns = []
    try:
        conns.append(worker(first, 0))
        conns[-1].register_kv_caches(regions[0][1])
        # The second engine's rank 1 comes before the first engine's: it must not join.
        conns.append(worker(second, 1))
        conns[-1].register_kv_caches(regions[1][1])
        intruder = conns[-1]._w().registration
        time.sleep(0.5)  # it retries meanwhile
        assert not intruder.connected and not intruder.superseded
        err = intruder.last_error or ""
        assert "FAILED_PRECONDITION" in err, err
        assert f'instance "{uid}" tp_rank 1 pp_rank 0: instance "{uid}" is registered by another engine' in err
        assert f'its engine_id "{a}", this rank\'s "{b}"' in err, err
        assert intruder.stats()["register_failures"] >= 1

        # The first engine's own rank 1 joins, and its instance round-trips in its own memory.
        conns.append(worker(first, 1))
        conns[-1].register_kv_caches(regions[2][1])
        assert conns[-1]._w().registration.connected and conns[0]._w().registration.connected
        assert sorted(registered(server, uid)) == [(0, a), (1, a)]
        assert round_trip(client, uid, [regions[0][1], regions[2][1]]) == []
        kv = next(iter(regions[1][1].values()))
        assert not np.any(kv[:, 6]), "nothing was loaded into the second engine's memory"
        assert not intruder.connected
    finally:
        close_all(conns, regions)


def test_a_config_without_an_engine_id_registers_none_and_keeps_the_instance_default(uid):
    """A host config without vLLM's engine_id (None, or no such attribute): no engine id ("", not
    checked by the server): one made up per process would differ between the workers, each of
    which unpickles its own copy of the config. The instance id's default is unchanged."""

    def cfg(kt) -> VllmConfig:
        return VllmConfig(
            model_config=ModelConfig(model="tiny", dtype=torch.float16, num_layers=2, num_kv_heads=4, head_size=8),
            kv_transfer_config=kt,
        )

    env = {"PEGAFLOW_NAMESPACE": "ns-" + uid}
    none = KVTransferConfig()
    none.engine_id = None  # set after vLLM's __post_init__
    bare = types.SimpleNamespace(kv_connector_extra_config={})
    for kt in (none, bare):
        one = ConnectorSettings.from_vllm(cfg(kt), env)
        again = ConnectorSettings.from_vllm(pickle.loads(pickle.dumps(cfg(kt))), env)
        assert one.engine_id == again.engine_id == ""
        assert one.instance_id == again.instance_id == "engine-ns-" + uid
    given = KVTransferConfig(engine_id="e-" + uid)
    assert ConnectorSettings.from_vllm(cfg(given), env).engine_id == "e-" + uid
    assert KVTransferConfig().engine_id != KVTransferConfig().engine_id  # vLLM's default: a uuid4 each


def test_a_tp2_config_without_an_engine_id_pickled_to_each_worker_registers_both_ranks(server, client, uid):
    """As vLLM ships it: each worker builds its connector from its own unpickled copy of the
    config. Without an engine id in it, both ranks still join one instance and round-trip."""
    cfg = tp2_config(server.addr, uid)
    cfg.kv_transfer_config.engine_id = None
    regions, conns = [make_kv(2, 8) for _ in range(2)], []
    try:
        regs = start_ranks(cfg, regions, conns)
        wait_for(lambda: all(r.connected for r in regs), "both ranks to register", timeout_s=5)
        assert sorted(registered(server, uid)) == [(0, ""), (1, "")]
        assert round_trip(client, uid, [kv for _, kv in regions]) == []
    finally:
        close_all(conns, regions)


def test_after_a_server_restart_every_rank_re_registers_with_the_engines_id(uid):
    """The restarted server has no instance: whichever rank re-registers first records the engine
    id, and the other rank, sending the same one, joins it."""
    from server_proc import ServerProc

    s1 = ServerProc.start()
    s2 = None
    cfg = tp2_config(s1.addr, uid)
    eid = cfg.kv_transfer_config.engine_id
    regions, conns = [make_kv(2, 8) for _ in range(2)], []
    try:
        regs = start_ranks(cfg, regions, conns)
        assert all(r.connected for r in regs)
        s1.kill()
        wait_for(lambda: not any(r.connected for r in regs), "the sessions to notice the dead server")
        s2 = ServerProc.start(s1.addr)  # same address, no instance
        wait_for(lambda: all(r.connected for r in regs), "both ranks to re-register")
        assert [r.generation for r in regs] == [2, 2]
        assert sorted(registered(s2, uid)) == [(0, eid), (1, eid)]
        client = PegaflowClient(s2.addr, rpc_timeout_ms=10_000)
        try:
            assert round_trip(client, uid, [kv for _, kv in regions]) == []
        finally:
            client.close()
    finally:
        close_all(conns, regions)
        for s in (s1, s2):
            if s is not None:
                s.stop()



def test_a_client_stamps_its_engine_id_on_every_request_and_a_call_may_name_another(server, uid):
    """`PegaflowClient(engine_id=…)` sends its id with RegisterContext, Save, QueryPrefetch and
    Load without any per-call argument: under an instance its id registered, a client of another
    id is refused FAILED_PRECONDITION naming both, its own goes through. A call's `engine_id=`
    wins over the client's, and an override of "" sends "" (not checked)."""
    e1, e2 = "e1-" + uid, "e2-" + uid
    one = PegaflowClient(server.addr, rpc_timeout_ms=10_000, engine_id=e1)
    two = PegaflowClient(server.addr, rpc_timeout_ms=10_000, engine_id=e2)
    assert (one.engine_id, two.engine_id) == (e1, e2)
    region, kv = make_kv(2, 8)
    reg = None

    def refused(call, **kw) -> str:
        """The details of `call`'s refusal as e2's under e1's instance."""
        with pytest.raises(PegaflowError) as e:
            call(**kw)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
        assert f'its engine_id "{e1}", this ' in e.value.details, e.value
        assert f'\'s "{e2}")' in e.value.details, e.value  # this rank's / this request's
        return e.value.details

    try:
        reg = register(one, kv, uid, "ns-" + uid)  # RegisterContext with the client's id
        assert reg.connected and registered(server, uid) == [(0, e1)]
        layers, device = export_kv_layers(kv)
        rank = dict(
            instance_id=uid, namespace="ns-" + uid, tp_rank=0, tp_size=1, device_id=device,
            layer_names=[l.name for l in layers], region_handles=[l.handle for l in layers],
            geometry=[l.geometry for l in layers],
        )
        assert "this rank's" in refused(two.register_context, **rank)
        assert "this rank's" in refused(one.register_context, **rank, engine_id=e2)

        h = [b"\x21" * 16]
        fill(kv, [1], h)
        save = dict(instance_id=uid, tp_rank=0, block_ids=[1], block_hashes=h)
        assert refused(two.save, **save).startswith("Save (tp_rank 0 pp_rank 0)")
        refused(one.save, **save, engine_id=e2)
        assert one.save(**save).blocks_saved == 1

        ask = dict(instance_id=uid, block_hashes=h)
        assert 'request "q-two"' in refused(two.query_prefetch, **ask, request_id="q-two")
        refused(one.query_prefetch, **ask, request_id="q-over", engine_id=e2)
        q = two.query_prefetch(**ask, request_id="q-empty", engine_id="")  # "" is sent, not e2
        assert q.hits == 1
        two.release(q.lease_id)
        q = one.query_prefetch(**ask, request_id="q-one")
        assert q.hits == 1

        with LoadState.create() as st:
            load = dict(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=[6], load_state_shm=st.name)
            assert refused(two.load, **load).startswith("Load (tp_rank 0 pp_rank 0")
            assert st.state == STATE_REJECTED
            st.rearm()
            refused(one.load, **load, engine_id=e2)
            st.rearm()
            one.load(**load)  # the refused Loads left the lease as it was
            st.wait_all(timeout_s=30)
        assert matches(kv, [6], h) == []
    finally:
        if reg is not None:
            reg.close()
        for c in (one, two):
            c.close()
        region.close()
