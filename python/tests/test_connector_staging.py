"""Layer-wise loads through staging blocks (pegaflow.staging_blocks, connector/staging.py):
the server copies into a contiguous run of the worker's staging blocks, registered as a
second instance of the namespace, and each layer is scattered into the request's own
blocks before its attention — whatever order those blocks come in. Both load issuers,
against a real host-backend server."""

from __future__ import annotations

import grpc
import pytest

from pegaflow.errors import PegaflowError
from pegaflow.connector.staging import STAGING_SUFFIX, StagingRoom, staging_instance
from pegaflow.hashes import synthetic_tokens

from vllm_driver import BLOCK, Engine, Request, lose_leases_after_alloc

ISSUERS = ["worker", "scheduler"]


@pytest.fixture
def make_engine(engine_factory):
    def make(staging: int, issuer: str) -> Engine:
        return engine_factory(
            "layerwise", **{"pegaflow.staging_blocks": staging, "pegaflow.load_issuer": issuer}
        )

    return make


def _cold(eng: Engine, uid: str, seed: int, blocks: int) -> tuple:
    prompt = synthetic_tokens(seed, blocks * BLOCK + 2)
    cold = Request("cold", prompt, salt=uid)
    assert eng.run_prefill(cold) == 0
    eng.finish(cold)
    eng.drain("cold")
    return prompt, cold


@pytest.mark.parametrize("issuer", ISSUERS)
def test_a_staged_load_lands_byte_exact_in_blocks_given_in_reverse_order(make_engine, uid, issuer):
    eng = make_engine(16, issuer)
    prompt, cold = _cold(eng, uid, 41, 6)
    # The free list handed out backwards (as vLLM's after a request frees its blocks).
    eng.free = sorted(eng.free, reverse=True)
    warm = Request("warm", list(prompt), salt=uid)
    assert eng.run_prefill(warm, avoid=set(cold.block_ids)) == 6 * BLOCK
    assert warm.block_ids[:6] == sorted(warm.block_ids[:6], reverse=True)
    # Every layer held the loaded prefix before its attention ran, and the bytes are right.
    assert eng.layer_violations == [] and eng.invalid_blocks == set()
    assert eng.holds_all(warm, warm.num_tokens)
    assert eng.sched._s().load_instance == staging_instance(eng.sched._s().instance_id)


def test_a_prefix_longer_than_the_staging_blocks_loads_what_fits_and_computes_the_rest(make_engine, uid):
    eng = make_engine(3, "scheduler")
    prompt, cold = _cold(eng, uid, 42, 6)
    warm = Request("warm", list(prompt), salt=uid)
    assert eng.run_prefill(warm, avoid=set(cold.block_ids)) == 3 * BLOCK
    assert eng.layer_violations == [] and eng.holds_all(warm, warm.num_tokens)
    assert eng.sched._s().stats["staging_full"] == 0  # capped, not refused


@pytest.mark.parametrize("issuer", ISSUERS)
def test_a_failed_staged_load_reports_the_requests_own_blocks(make_engine, uid, issuer):
    eng = make_engine(16, issuer)
    prompt, cold = _cold(eng, uid, 43, 5)
    if issuer == "worker":
        # The lease is given back between the scheduler's decision and the worker's Load.
        lose_leases_after_alloc(eng)
    else:
        # The scheduler's Load is refused (as by a server that lost the instance).
        def refused(*, on_done, **_kw):
            on_done(PegaflowError(grpc.StatusCode.FAILED_PRECONDITION, "refused by the test", "Load"))

        eng.sched._s().client.load_nowait = refused
    warm = Request("warm", list(prompt), salt=uid)
    eng.run_prefill(warm, avoid=set(cold.block_ids))
    assert eng.invalid_blocks == set(warm.block_ids[:5])  # not the staging blocks 0..4
    assert eng.holds_all(warm, warm.num_tokens)  # recomputed


def test_staging_room_reserves_per_probe_and_frees_at_each_step():
    room = StagingRoom(10)
    assert room.offer(7) == 7
    room.reserve(7)
    assert room.offer(7) == 3  # another probe in the same step gets what is left
    assert room.take(5, reserved=7) == 0  # allocated 5 of its 7 hits: 2 go back
    assert room.offer(10) == 5
    room.reserve(5)
    assert room.take(5, reserved=5) == 5
    with pytest.raises(ValueError, match="0 free"):
        room.take(1, reserved=0)
    room.next_step()
    assert room.offer(10) == 10


def test_the_staging_instance_stays_within_the_name_limit():
    assert staging_instance("engine-1") == "engine-1" + STAGING_SUFFIX
    long_a, long_b = "a" * 127 + "x", "a" * 127 + "y"
    sa, sb = staging_instance(long_a), staging_instance(long_b)
    assert len(sa) <= 128 and len(sb) <= 128 and sa != sb and sa.endswith(STAGING_SUFFIX)
