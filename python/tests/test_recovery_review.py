"""Review of the client's recovery from a server restart (the reconnect thread, `registered_anew`):

- a server that answers every call UNAVAILABLE at once (the Deno server from the moment it begins
  stopping until it exits: its engine drains every instance and closes the SSD tier meanwhile)
  had the `pegaflow-reconnect` thread ask Health again at once, in a loop with no pause: thousands
  of calls a second from every engine process, a core spent beside the engine's steps and the
  stopping server's event loop flooded;
- a client dropped without close() while its server was away kept its reconnect thread (and
  channel) for good;
- a rank's registration whose answer its thread had not taken in yet when a load began counted as
  "registered anew" once taken in: the load (of a Load that very registration took, and whose
  copy may be running) was let go at once, its request's blocks freed under the copy.
"""

from __future__ import annotations

import gc
import threading
import time
from concurrent import futures
from typing import List

import grpc
import pytest

from pegaflow._proto import pegaflow_pb2 as pb
from pegaflow.client import CallNotSent, PegaflowClient
from pegaflow.connector.plan import LAYERWISE, LoadIntent, StepPlan
from pegaflow.connector.worker_core import WorkerCore
from pegaflow.errors import PegaflowError
from pegaflow.load_state import LoadState

from kv_helpers import make_kv
from server_proc import free_addr
from waits import wait_for


# ---- the reconnect thread against a server that refuses every call ---------------------------


@pytest.fixture
def stopping_server():
    """A gRPC server whose Health answers UNAVAILABLE at once ("Health: server is stopping", as the
    Deno server answers every call once it began stopping); yields (address, the times of the
    Health calls it got)."""
    calls: List[float] = []

    def health(req, ctx):
        calls.append(time.monotonic())
        ctx.abort(grpc.StatusCode.UNAVAILABLE, "Health: server is stopping")

    handler = grpc.method_handlers_generic_handler("pegaflow.Engine", {
        "Health": grpc.unary_unary_rpc_method_handler(
            health, pb.HealthRequest.FromString, pb.HealthResponse.SerializeToString),
    })
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", calls
    srv.stop(0)


def test_the_reconnect_thread_pauses_between_calls_a_stopping_server_refuses(stopping_server):
    """The thread asked Health again as soon as one failed UNAVAILABLE: a server that answers
    UNAVAILABLE at once (stopping) got thousands of Health calls a second (2300/s measured
    against a Python server), a core of the engine spent on them. It now pauses between them,
    doubling up to reconnect_max_ms, and close() still ends it at once."""
    addr, calls = stopping_server
    c = PegaflowClient(addr, rpc_timeout_ms=5000, reconnect_max_ms=400)
    try:
        with pytest.raises(PegaflowError) as e:
            c.health()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        wait_for(lambda: len(calls) >= 3, "the reconnect thread to ask Health")
        n0, t0 = len(calls), time.monotonic()
        end = t0 + 1.0
        while time.monotonic() < end and len(calls) - n0 < 200:  # an observation window, cut short by a spin
            time.sleep(0.01)
        asked = len(calls) - n0
        assert asked <= 20, f"the reconnect thread asked Health {asked} times in {time.monotonic() - t0:.2f} s"
        t1 = time.monotonic()
        c.close()
        assert time.monotonic() - t1 < 1.0, "close() waited for the reconnect thread's pause"
        assert not [t for t in threading.enumerate() if t.name == "pegaflow-reconnect"]
    finally:
        c.close()


def test_a_client_dropped_without_close_while_its_server_is_away_leaves_no_reconnect_thread():
    """The reconnect thread held its client (and the client its channel) for as long as the
    server stayed away: a client dropped without close() during an outage kept a thread and a
    channel reconnecting for good (before that thread, the dropped channel was collected). The
    thread now holds its client weakly and ends once it is gone."""
    c = PegaflowClient(free_addr(), rpc_timeout_ms=300, reconnect_max_ms=200)
    with pytest.raises(CallNotSent):
        c.health()  # no server: the channel is down, the thread drives it
    driving = c._reconnect[1]
    assert driving.is_alive()
    del c
    gc.collect()
    driving.join(10)
    assert not driving.is_alive(), "the reconnect thread of a dropped client still runs"


# ---- a registration taken in after a load began -------------------------------------------------


def test_a_registration_whose_answer_was_not_taken_in_when_the_load_began_does_not_let_it_go(server, uid):
    """The scheduler's Load was taken by the rank's new registration (the server registered the
    rank, then a query hit and the scheduler sent the Load) while the rank's session thread had not
    taken in that RegisterContext's answer yet (the worker read `connected` False: "not
    registered", the load lingers). Taking the answer in bumped `registered_anew` past the load's
    snapshot, and the next poll let the load go as one whose server was gone: the request was
    reported finished (its blocks freed for reuse) while the server that took the Load, alive,
    may still copy into them. Only a registration begun after the load began means the Load's
    server no longer holds the rank."""
    client = PegaflowClient(server.addr, rpc_timeout_ms=5000, reconnect_max_ms=200)
    region, kv = make_kv(2, 8)
    w = WorkerCore(client, instance_id=uid, namespace="ns-" + uid, mode=LAYERWISE, load_timeout_s=20.0)
    st = LoadState.create()  # the scheduler's state of that Load: pending while the server copies
    proceed = threading.Event()
    try:
        w.register_kv_caches(kv)
        reg = w.registration
        assert reg.connected
        real = client.register_context
        answered = threading.Event()
        gate = {"on": True}

        def register_context(**kw):
            res = real(**kw)  # the server registered the rank now
            if gate["on"]:
                gate["on"] = False
                answered.set()
                proceed.wait(30)  # the session thread, descheduled before it takes the answer in
            return res

        client.register_context = register_context
        client.unregister_context(uid)  # the server cleans the instance up: the session ends
        assert answered.wait(20), "the rank never registered again"
        assert not reg.connected
        w.bind(StepPlan(loads=[LoadIntent("r", b"\x01" * 16, [2, 3], states={(0, 0): st.name})]))
        w.start_load()
        w.wait_for_layer_load(next(iter(kv)))
        w.wait_for_save()
        w.unbind()
        assert w.take_load_errors() == {2, 3}  # not registered when it began: recomputed
        proceed.set()
        wait_for(lambda: reg.connected, "the session to open")
        assert w.get_finished({"r"}) == (None, None), (
            "the request's blocks were let go while the registration that took its Load may still copy"
        )
        assert w.stats["loads_abandoned"] == 0
        st.mark_failed()  # the server settles it
        assert w.get_finished(set()) == ({"r"}, None)
    finally:
        proceed.set()
        st.mark_failed()
        w.close()
        client.close()
        region.close()
        st.close()
