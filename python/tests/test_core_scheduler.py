"""Scheduler-side state machine rules, checked against a recording stand-in
for the client (the same rules run against the real server in test_connector.py):
probes are cached (repeated calls are side-effect free), drift or disuse
releases the lease, "loading" is waited for with a WaitPrefetch (or, without one, asked again
after a growing pause; never cached), hits leave the last token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import grpc
import pytest

from pegaflow.client import QueryResult
from pegaflow.config import ClientConfig
from pegaflow.connector.plan import ScheduledRequest
from pegaflow.connector.scheduler_core import LOADING_RETRY_FIRST_S, LOADING_WAIT_MS, SchedulerCore
from pegaflow.errors import PegaflowError

BS = 4


@dataclass
class Req:
    request_id: str
    num_tokens: int
    block_hashes: List[bytes] = field(default_factory=list)


class FakeClient:
    config = ClientConfig()

    def __init__(self, answers, engine_id=""):
        self.answers = list(answers)
        self.engine_id = engine_id
        self.queries = []
        self.released = []
        self.engine_ids = []

    def query_prefetch(self, *, instance_id, block_hashes, request_id, timeout_s=None, engine_id=None):
        """Records the engine id the query carries: the call's, else the client's (as PegaflowClient)."""
        self.queries.append(list(block_hashes))
        self.engine_ids.append(self.engine_id if engine_id is None else engine_id)
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    def release(self, lease_id, timeout_s=None):
        self.released.append(lease_id)

    address = "fake:0"
    #: WaitPrefetches sent: (instance, request, wait_ms, on_done); the test answers them.
    waits: List[tuple] = []
    #: Raised by wait_prefetch_nowait when set (the call could not be sent).
    wait_error = None

    def wait_prefetch_nowait(self, *, instance_id, request_id, wait_ms, on_done, timeout_s=None, engine_id=None):
        if self.wait_error is not None:
            raise self.wait_error
        self.waits = self.waits + [(instance_id, request_id, wait_ms, on_done)]


def hashes(n):
    return [bytes([i + 1]) * 8 for i in range(n)]


def ready(hits, lease=b"L" * 16):
    return QueryResult(loading=False, hits=hits, lease_id=lease if hits else b"", ttl_ms=600_000)


def test_repeated_calls_ask_the_server_once_and_answer_the_same():
    c = FakeClient([ready(3)])
    s = SchedulerCore(c, instance_id="i", block_size=BS, mode="async")
    r = Req("r", 5 * BS + 1, hashes(5))
    assert s.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    assert s.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    assert len(c.queries) == 1 and c.released == []


def test_only_hashes_past_the_local_prefix_and_before_the_last_token_are_asked():
    c = FakeClient([ready(0)])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    r = Req("r", 4 * BS, hashes(4))  # the 4th block holds the last token
    assert s.get_num_new_matched_tokens(r, BS) == (0, False)
    assert c.queries == [hashes(4)[1:3]]


def test_a_changed_local_prefix_releases_the_old_lease_and_asks_again():
    c = FakeClient([ready(3, b"A" * 16), ready(1, b"B" * 16)])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    r = Req("r", 5 * BS + 1, hashes(5))
    s.get_num_new_matched_tokens(r, 0)
    assert s.get_num_new_matched_tokens(r, 2 * BS) == (BS, False)
    assert c.released == [b"A" * 16] and len(c.queries) == 2


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_loading_answers_none_and_is_asked_again_after_a_pause():
    c = FakeClient([QueryResult(loading=True), ready(2)])
    clock = Clock()
    s = SchedulerCore(c, instance_id="i", block_size=BS, clock=clock, loading_wait_ms=0)
    r = Req("r", 3 * BS + 1, hashes(3))
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # too soon: no query
    assert len(c.queries) == 1 and s.stats["query_loading_deferred"] == 1
    clock.t += LOADING_RETRY_FIRST_S
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, False)
    assert len(c.queries) == 2


def test_the_pause_after_loading_doubles_up_to_the_cap_and_a_hit_ends_it():
    n = 12
    c = FakeClient([QueryResult(loading=True)] * n + [ready(2), QueryResult(loading=True)])
    clock = Clock()
    s = SchedulerCore(c, instance_id="i", block_size=BS, loading_retry_s=0.002, clock=clock, loading_wait_ms=0)
    r = Req("r", 3 * BS + 1, hashes(3))
    asked_at = []
    while len(c.queries) < n:  # an engine stepping every 0.1 ms while it only waits
        before = len(c.queries)
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
        if len(c.queries) > before:
            asked_at.append(clock.t)
        clock.t += 0.0001
    gaps = [round(b - a, 5) for a, b in zip(asked_at, asked_at[1:])]
    assert gaps[:3] == [0.0003, 0.0005, 0.001]  # 0.25, 0.5, 1 ms, each rounded up to a step
    assert gaps[-3:] == [0.002, 0.002, 0.002]  # the cap
    clock.t += 0.002
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, False)
    # The hit ended the waiting: a later "loading" starts from the first pause again.
    s2 = Req("r2", 3 * BS + 1, hashes(3))
    assert s.get_num_new_matched_tokens(s2, 0) == (None, False)
    assert s._waiting["r2"].pause == LOADING_RETRY_FIRST_S


def test_a_changed_probe_or_a_finished_request_is_not_held_back_by_its_pause():
    c = FakeClient([QueryResult(loading=True), QueryResult(loading=True), ready(1)])
    clock = Clock()
    s = SchedulerCore(c, instance_id="i", block_size=BS, clock=clock, loading_wait_ms=0)
    r = Req("r", 3 * BS + 1, hashes(3))
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.get_num_new_matched_tokens(r, BS) == (None, False)  # other local prefix: asked at once
    assert len(c.queries) == 2
    s.request_finished(r)
    assert "r" not in s._waiting
    assert s.get_num_new_matched_tokens(Req("r", 3 * BS + 1, hashes(3)), 0) == (BS, False)


def test_loading_retry_zero_asks_at_every_call():
    c = FakeClient([QueryResult(loading=True)] * 3)
    s = SchedulerCore(c, instance_id="i", block_size=BS, loading_retry_s=0, clock=Clock(), loading_wait_ms=0)
    r = Req("r", 3 * BS + 1, hashes(3))
    for _ in range(3):
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert len(c.queries) == 3
    with pytest.raises(ValueError, match="loading_retry_s"):
        SchedulerCore(c, instance_id="i", block_size=BS, loading_retry_s=-1)


def test_loading_sends_one_wait_and_asks_again_only_once_it_is_answered():
    c = FakeClient([QueryResult(loading=True), ready(2)])
    clock = Clock()
    s = SchedulerCore(c, instance_id="i", block_size=BS, clock=clock)
    r = Req("r", 3 * BS + 1, hashes(3))
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert [(i, q, ms) for i, q, ms, _ in c.waits] == [("i", "r", LOADING_WAIT_MS)]
    for _ in range(50):  # an engine stepping while the fetch runs: no query, no second wait
        clock.t += 0.001
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert len(c.queries) == 1 and len(c.waits) == 1
    c.waits[0][3](True, None)  # the server: the fetch ended (on the client's reader thread)
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, False)
    assert len(c.queries) == 2 and s.stats["waits"] == 1 and "r" not in s._waiting


def test_a_wait_that_passed_while_the_fetch_runs_asks_again_and_waits_again():
    c = FakeClient([QueryResult(loading=True), QueryResult(loading=True), ready(1)])
    s = SchedulerCore(c, instance_id="i", block_size=BS, clock=Clock(), loading_wait_ms=7)
    r = Req("r", 3 * BS + 1, hashes(3))
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    c.waits[0][3](False, None)  # held 7 ms, still loading
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert len(c.queries) == 2 and [w[2] for w in c.waits] == [7, 7]
    c.waits[1][3](True, None)
    assert s.get_num_new_matched_tokens(r, 0) == (BS, False)


def test_an_unanswered_wait_is_bounded_by_its_hold(caplog):
    c = FakeClient([QueryResult(loading=True), QueryResult(loading=True)])
    clock = Clock()
    s = SchedulerCore(c, instance_id="i", block_size=BS, clock=clock, loading_wait_ms=20)
    r = Req("r", 3 * BS + 1, hashes(3))
    s.get_num_new_matched_tokens(r, 0)
    clock.t += 0.019
    assert s.get_num_new_matched_tokens(r, 0) == (None, False) and len(c.queries) == 1
    clock.t += 0.002  # past the hold with no answer (lost): asked again
    assert s.get_num_new_matched_tokens(r, 0) == (None, False) and len(c.queries) == 2


def test_a_server_without_wait_prefetch_is_polled_with_pauses_from_then_on(caplog):
    c = FakeClient([QueryResult(loading=True)] * 3)
    clock = Clock()
    s = SchedulerCore(c, instance_id="i", block_size=BS, clock=clock)
    r = Req("r", 3 * BS + 1, hashes(3))
    s.get_num_new_matched_tokens(r, 0)
    with caplog.at_level("WARNING", logger="pegaflow.connector"):
        c.waits[0][3](None, PegaflowError(grpc.StatusCode.UNIMPLEMENTED, "unknown method", "WaitPrefetch"))
    assert "has no WaitPrefetch" in caplog.text and s.loading_wait_ms == 0
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # asked at once after the answer
    assert len(c.queries) == 2 and len(c.waits) == 1, "no second wait: a pause instead"
    assert s._waiting["r"].pause == LOADING_RETRY_FIRST_S
    assert s.stats["wait_errors"] == 1


def test_a_wait_that_fails_in_flight_asks_again_at_once_and_keeps_waiting_on():
    # The server went away with the wait held (its connection ended): the next call queries,
    # and a server that answers "loading" again is waited for again.
    c = FakeClient([QueryResult(loading=True), QueryResult(loading=True), ready(1)])
    s = SchedulerCore(c, instance_id="i", block_size=BS, clock=Clock())
    r = Req("r", 3 * BS + 1, hashes(3))
    s.get_num_new_matched_tokens(r, 0)
    c.waits[0][3](None, PegaflowError(grpc.StatusCode.UNAVAILABLE, "connection ended", "WaitPrefetch"))
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert len(c.queries) == 2 and len(c.waits) == 2 and s.loading_wait_ms == LOADING_WAIT_MS
    assert s.stats["wait_errors"] == 1
    c.waits[1][3](True, None)
    assert s.get_num_new_matched_tokens(r, 0) == (BS, False)


def test_a_wait_that_could_not_be_sent_asks_again_after_the_first_pause():
    c = FakeClient([QueryResult(loading=True), ready(2)])
    c.wait_error = PegaflowError(grpc.StatusCode.UNAVAILABLE, "connection refused", "WaitPrefetch")
    clock = Clock()
    s = SchedulerCore(c, instance_id="i", block_size=BS, clock=clock)
    r = Req("r", 3 * BS + 1, hashes(3))
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.stats["wait_errors"] == 1
    assert s.get_num_new_matched_tokens(r, 0) == (None, False) and len(c.queries) == 1
    clock.t += LOADING_RETRY_FIRST_S
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, False)


def test_loading_wait_ms_out_of_range_is_refused():
    for bad in (-1, 60001, 1.5):
        with pytest.raises(ValueError, match="loading_wait_ms must be 0..60000"):
            SchedulerCore(FakeClient([]), instance_id="i", block_size=BS, loading_wait_ms=bad)


def test_an_unused_probe_gives_its_lease_back():
    c = FakeClient([ready(2, b"A" * 16), ready(2, b"B" * 16)])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    r = Req("r", 3 * BS + 1, hashes(3))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, [5, 6, 7, 8], 0)  # the scheduler decided not to load
    assert c.released == [b"A" * 16]
    r2 = Req("r2", 3 * BS + 1, hashes(3))
    s.get_num_new_matched_tokens(r2, 0)
    assert s.request_finished(r2) is False  # aborted while waiting
    assert c.released == [b"A" * 16, b"B" * 16]


def test_a_failed_query_is_a_counted_miss():
    c = FakeClient([PegaflowError(grpc.StatusCode.UNAVAILABLE, "down", "QueryPrefetch")])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    assert s.get_num_new_matched_tokens(Req("r", 9, hashes(2)), 0) == (0, False)
    assert s.stats["query_errors"] == 1


def test_load_intent_targets_the_blocks_after_the_local_prefix_and_saves_skip_loaded_blocks():
    c = FakeClient([ready(2)])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    r = Req("r", 5 * BS + 1, hashes(5))
    assert s.get_num_new_matched_tokens(r, BS) == (2 * BS, False)
    s.update_state_after_alloc(r, [10, 11, 12, 13, 14, 15], 2 * BS)
    plan = s.build_step([ScheduledRequest("r", [10, 11, 12, 13, 14, 15], True, 3 * BS, 2 * BS + 1)])
    assert [(l.block_ids, l.lease_id) for l in plan.loads] == [([11, 12], b"L" * 16)]
    assert [(x.block_ids, x.block_hashes) for x in plan.saves] == [([13, 14], hashes(5)[3:5])]
    assert s.build_step([]).loads == []  # build_step resets the step's state


def test_more_external_tokens_than_offered_is_refused_and_the_lease_given_back():
    c = FakeClient([ready(1)])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    r = Req("q", 5 * BS + 1, hashes(5))
    s.get_num_new_matched_tokens(r, 0)
    with pytest.raises(ValueError, match="exceed"):
        s.update_state_after_alloc(r, [1, 2, 3], 2 * BS)
    assert c.released == [b"L" * 16]


def test_decode_saves_each_block_once_as_it_fills():
    c = FakeClient([ready(0)])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    r = Req("r", BS + 2, hashes(1))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, [3, 4], 0)
    p = s.build_step([ScheduledRequest("r", [3, 4], True, 0, BS + 2)])
    assert [x.block_ids for x in p.saves] == [[3]]
    r.block_hashes = hashes(2)  # the engine appended tokens; block 2 is full now
    p = s.build_step([ScheduledRequest("r", None, False, BS + 2, 1)])
    assert p.saves == []
    p = s.build_step([ScheduledRequest("r", None, False, BS + 3, 1)])
    assert [x.block_ids for x in p.saves] == [[4]]
    assert s.request_finished(r) is True


def test_hashes_finer_than_a_block_are_never_queried_nor_saved(caplog):
    # vLLM hashes every hash_block_size tokens (hybrid KV groups, a prefix_match_unit below the
    # block size): block i stored under hashes[i] would cover only part of its tokens, and be
    # served to a prompt that shares just those.
    c = FakeClient([ready(3)])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    r = Req("r", 4 * BS + 1, hashes(8))  # one hash per BS / 2 tokens
    with caplog.at_level("ERROR", logger="pegaflow.connector"):
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        assert s.get_num_new_matched_tokens(Req("r2", 4 * BS + 1, hashes(8)), 0) == (0, False)
    assert c.queries == []
    s.update_state_after_alloc(r, [1, 2, 3, 4, 5], 0)
    p = s.build_step([ScheduledRequest("r", [1, 2, 3, 4, 5], True, 0, 4 * BS + 1)])
    assert p.saves == []
    errors = [m for m in caplog.messages if "block hashes" in m]
    assert len(errors) == 1 and "request r:" in errors[0] and "need 4 block hashes, the engine gave 8" in errors[0]
    assert s.stats["hash_granularity_refused"] == 2


def test_no_block_hashes_prefix_caching_off_is_a_miss_said_once(caplog):
    c = FakeClient([])
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    with caplog.at_level("ERROR", logger="pegaflow.connector"):
        assert s.get_num_new_matched_tokens(Req("r", 3 * BS, []), 0) == (0, False)
    assert c.queries == []
    assert any("prefix caching off" in m for m in caplog.messages)
    # A prompt shorter than a block has no hash and needs none: it is tracked as usual.
    assert s.get_num_new_matched_tokens(Req("short", BS - 1, []), 0) == (0, False)
    assert s.stats["hash_granularity_refused"] == 1


def test_a_query_refused_as_another_engines_is_a_miss_counted_and_said_once(caplog):
    """Every query carries the engine id of the scheduler's client; the server's refusal of another
    engine's (this engine misconfigured with that instance id) is a miss like any failed query,
    never an exception into the step, counted apart and logged once as an error."""
    refused = PegaflowError(
        grpc.StatusCode.FAILED_PRECONDITION,
        'QueryPrefetch (request "r"): instance "i" is registered by another engine (its engine_id "a", '
        "this request's \"b\"); an engine's requests carry the engine_id its ranks registered with",
        "QueryPrefetch",
    )
    away = PegaflowError(grpc.StatusCode.UNAVAILABLE, "connection refused", "QueryPrefetch")
    c = FakeClient([refused, refused, away, ready(2)], engine_id="b")
    s = SchedulerCore(c, instance_id="i", block_size=BS)
    with caplog.at_level("DEBUG", logger="pegaflow.connector"):
        for rid in ("r", "r2", "r3"):
            assert s.get_num_new_matched_tokens(Req(rid, 3 * BS + 1, hashes(3)), 0) == (0, False)
        assert s.get_num_new_matched_tokens(Req("r4", 3 * BS + 1, hashes(3)), 0) == (2 * BS, False)
    assert c.engine_ids == ["b"] * 4
    assert (s.stats["query_errors"], s.stats["query_other_engine"]) == (3, 2)
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1 and "instance i (engine_id 'b') is registered by another engine" in said[0], said

