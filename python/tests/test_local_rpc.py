"""The hot calls over the server's local RPC socket (`--uds PATH` serves `PATH.rpc`):
the client uses it for a unix: address, answers and errors are gRPC's, a silent
socket hits the deadline, a restarted server is found again, and a server without
the socket is reached over gRPC."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time

import grpc
import pytest

from pegaflow.client import PegaflowClient
from pegaflow.config import ClientConfig
from pegaflow.errors import PegaflowError
from pegaflow.load_state import LoadState

from kv_helpers import fill, make_kv, matches, register
from server_proc import ServerProc, silent_local_rpc


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="pf-lrpc-")
    yield d
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)


def test_save_query_and_both_loads_go_over_the_local_socket_byte_exact(uid, sock_dir):
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    region, kv = make_kv(2, 16)
    c = PegaflowClient("unix:" + sock)
    try:
        assert c._local is not None and c._local.path == sock + ".rpc"
        reg = register(c, kv, uid, "ns-" + uid)
        before = c._local.calls
        hashes = [bytes([i]) * 16 for i in range(1, 5)]
        fill(kv, [1, 2, 3, 4], hashes)
        assert c.save(instance_id=uid, tp_rank=0, block_ids=[1, 2, 3, 4], block_hashes=hashes).blocks_saved == 4
        q = c.query_prefetch(instance_id=uid, block_hashes=hashes[:2], request_id="r1")
        assert q.hits == 2
        with LoadState.create() as st:
            c.load(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=[7, 8], load_state_shm=st.name)
            st.wait_all(timeout_s=30)
        q2 = c.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="r2")
        done = threading.Event()
        errs = []
        with LoadState.create() as st:
            c.load_nowait(
                instance_id=uid, tp_rank=0, lease_id=q2.lease_id, block_ids=[10, 11, 12, 13],
                load_state_shm=st.name, on_done=lambda e: (errs.append(e), done.set()),
            )
            assert done.wait(30) and errs == [None]
            st.wait_all(timeout_s=30)
        assert matches(kv, [7, 8], hashes[:2]) == []
        assert matches(kv, [10, 11, 12, 13], hashes) == []
        assert c._local.calls - before == 5  # save, 2 queries, 2 loads
        reg.close()
    finally:
        c.close()
        region.close()
        s.stop()


@pytest.mark.parametrize("transport", ["local", "grpc"])
def test_a_query_with_load_into_starts_the_load_before_it_answers(uid, sock_dir, transport):
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    region, kv = make_kv(2, 16)
    c = PegaflowClient("unix:" + sock if transport == "local" else s.addr)
    try:
        reg = register(c, kv, uid, "ns-" + uid)
        hashes = [bytes([i]) * 16 for i in range(1, 5)]
        fill(kv, [1, 2, 3], hashes[:3])
        c.save(instance_id=uid, tp_rank=0, block_ids=[1, 2, 3], block_hashes=hashes[:3])
        with LoadState.create() as st:
            q = c.query_prefetch(
                instance_id=uid, block_hashes=hashes, request_id="r-ql",
                load_into=[9, 10, 11, 12], load_states={(0, 0): st.name},
            )
            assert (q.hits, q.load_errors) == (3, [])
            assert [(o.tp_rank, o.pp_rank, o.num_blocks) for o in q.loads] == [(0, 0, 3)]
            st.wait_all(timeout_s=30)
        assert matches(kv, [9, 10, 11], hashes[:3]) == []
        with pytest.raises(PegaflowError) as e:
            c.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="r-bad", load_into=[9],
                             load_states={(0, 0): "/pegaflow-unused"})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "1 targets for 4 hashes" in e.value.details
        with pytest.raises(ValueError, match="load_states"):
            c.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="r-x", load_into=[1, 2, 3, 4])
        reg.close()
    finally:
        c.close()
        region.close()
        s.stop()


def test_local_socket_and_grpc_answer_the_same_error(sock_dir):
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    local = PegaflowClient("unix:" + sock)
    remote = PegaflowClient(config=ClientConfig.resolve(addr="unix:" + sock, local_rpc=False))
    try:
        assert remote._local is None
        errs = []
        for c in (local, remote):
            with pytest.raises(PegaflowError) as ei:
                c.query_prefetch(instance_id="ghost", block_hashes=[b"x" * 32], request_id="req-9")
            errs.append((ei.value.code, ei.value.details, ei.value.method))
        assert errs[0] == errs[1]
        assert errs[0][0] == grpc.StatusCode.FAILED_PRECONDITION and "ghost" in errs[0][1]
        with pytest.raises(PegaflowError) as ei:
            local.release(b"short")
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and "expected 16" in ei.value.details
        assert local._local.calls == 2
    finally:
        local.close()
        remote.close()
        s.stop()


def test_a_socket_that_never_answers_hits_the_deadline_on_both_call_kinds(sock_dir):
    base = os.path.join(sock_dir, "silent.sock")
    with silent_local_rpc(base):
        c = PegaflowClient("unix:" + base, rpc_timeout_ms=300)
        try:
            t0 = time.monotonic()
            with pytest.raises(PegaflowError) as ei:
                c.query_prefetch(instance_id="i", block_hashes=[b"h" * 32], request_id="r")
            assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 5
            done = threading.Event()
            got = []
            c.load_nowait(
                instance_id="i", tp_rank=0, lease_id=b"l" * 16, block_ids=[1], load_state_shm="/x",
                on_done=lambda e: (got.append(e), done.set()),
            )
            assert done.wait(5)
            assert got[0] is not None and got[0].code == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            c.close()


def test_a_nowait_call_due_first_expires_at_its_own_deadline_behind_a_later_one(sock_dir):
    """The answer reader sleeps until the earliest deadline in flight: a call due in 0.3 s,
    sent while the reader sleeps for one due in 5 s, still ends at ~0.3 s."""
    base = os.path.join(sock_dir, "silent.sock")
    with silent_local_rpc(base):
        c = PegaflowClient("unix:" + base)
        try:
            ended: dict = {}
            done = threading.Event()

            def load(name: str, timeout_s: float) -> None:
                def on_done(e):
                    ended[name] = (time.monotonic(), e)
                    if len(ended) == 2:
                        done.set()

                c.load_nowait(
                    instance_id="i", tp_rank=0, lease_id=b"l" * 16, block_ids=[1], load_state_shm="/x",
                    on_done=on_done, timeout_s=timeout_s,
                )

            t0 = time.monotonic()
            load("late", 5.0)
            time.sleep(0.1)  # the reader is asleep until the late one's deadline
            load("early", 0.3)
            assert done.wait(10)
            early_at, early_err = ended["early"]
            late_at, late_err = ended["late"]
            assert early_err.code == late_err.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0.35 <= early_at - t0 < 1.5, early_at - t0
            assert late_at - t0 >= 5.0
        finally:
            c.close()


def test_a_nowait_send_that_fails_ends_its_sleeping_reader(sock_dir):
    """A send that fails drops the connection; its reader, asleep with no deadline in sight,
    is woken to close it and exits (no thread or descriptor left behind)."""
    from pegaflow.local_rpc import LocalRpc, LocalRpcStatus

    base = os.path.join(sock_dir, "silent.sock")
    with silent_local_rpc(base):
        rpc = LocalRpc(base + ".rpc", 64 << 20)
        try:
            got = []
            done = threading.Event()
            rpc.call_nowait(2, b"x", 0.2, lambda st, body: (got.append(st), done.set()))
            assert done.wait(5) and got == [4]  # DEADLINE_EXCEEDED: the reader now sleeps for good
            reader = rpc._reader
            time.sleep(0.1)
            assert reader.is_alive()
            # 16 MiB to a peer that reads nothing: the send times out at the call's 0.2 s.
            with pytest.raises(LocalRpcStatus) as ei:
                rpc.call_nowait(2, b"y" * (16 << 20), 0.2, lambda st, body: None)
            assert ei.value.code == 4  # DEADLINE_EXCEEDED
            reader.join(2.0)
            assert not reader.is_alive(), "the dropped connection's reader still sleeps"
        finally:
            rpc.close()


def test_an_idle_nowait_reader_does_not_wake(sock_dir, monkeypatch):
    """Between calls the answer reader sleeps for good: no periodic wakeups that would take the
    GIL from an engine's step (it used to tick every 50 ms)."""
    import select as select_mod

    from pegaflow import local_rpc

    waits = []

    class CountingPoll:
        def __init__(self):
            self.p = select_mod.poll()

        def register(self, fd, events):
            self.p.register(fd, events)

        def poll(self, timeout=None):
            waits.append(timeout)
            return self.p.poll(timeout)

    class CountingSelect:
        POLLIN = select_mod.POLLIN
        poll = CountingPoll

    monkeypatch.setattr(local_rpc, "select", CountingSelect)
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    c = PegaflowClient("unix:" + sock)
    try:
        got = []
        done = threading.Event()
        c.load_nowait(
            instance_id="nobody", tp_rank=0, lease_id=b"l" * 16, block_ids=[1], load_state_shm="/x",
            on_done=lambda e: (got.append(e), done.set()),
        )
        assert done.wait(5)
        assert got[0] is not None and got[0].code == grpc.StatusCode.INVALID_ARGUMENT  # answered
        time.sleep(0.2)
        before = len(waits)
        time.sleep(0.5)
        assert len(waits) == before, f"{len(waits) - before} wakeups in 0.5 s while idle"
        assert waits[-1] is None  # asleep with no deadline
        # Still serves: the next call wakes it through its answer.
        done.clear()
        got.clear()
        c.load_nowait(
            instance_id="nobody", tp_rank=0, lease_id=b"l" * 16, block_ids=[1], load_state_shm="/x",
            on_done=lambda e: (got.append(e), done.set()),
        )
        assert done.wait(5) and got[0].code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        c.close()
        s.stop()


def test_a_restarted_server_is_found_again_without_a_new_client(sock_dir):
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    c = PegaflowClient("unix:" + sock, rpc_timeout_ms=2000)
    try:
        assert c.health().status == "ok"
        assert c._local.calls == 1
        s.stop()
        with pytest.raises(PegaflowError) as ei:
            c.health()
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        s = ServerProc.start(extra=["--uds", sock])
        assert c.health().status == "ok"
        assert c._local is not None and c._local.calls >= 3
    finally:
        c.close()
        s.stop()


def test_a_server_restarted_between_two_calls_is_found_by_the_second(sock_dir):
    """A thread's idle connection to a server that restarted is dead: the next call found it
    so (a broken pipe before any of its frame was sent) and failed with UNAVAILABLE, on each
    thread of the engine, although the new server was up. It is now sent on a new one."""
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    c = PegaflowClient("unix:" + sock, rpc_timeout_ms=2000)
    try:
        assert c.health().status == "ok"
        s.stop()
        s = ServerProc.start(extra=["--uds", sock])
        before = c._local.calls
        assert c.health().status == "ok"
        assert c._local.calls == before + 1, "not sent over the local socket"
    finally:
        c.close()
        s.stop()


def test_a_threads_connection_is_closed_when_the_thread_ends(sock_dir):
    """Each thread's blocking calls use a connection of its own; the client kept every one
    (a descriptor here, a connection in the server) until it was closed, so an engine that
    calls from short-lived threads grew by one per thread."""
    import gc

    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    c = PegaflowClient("unix:" + sock)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    try:
        assert c.health().status == "ok"
        before, calls = fds(), c._local.calls
        for _ in range(20):
            t = threading.Thread(target=c.health)
            t.start()
            t.join()
        gc.collect()
        assert c._local.calls == calls + 20, "not sent over the local socket"
        assert fds() - before <= 1, f"{fds() - before} descriptors left by 20 ended threads"
        assert c.health().status == "ok"  # this thread's connection is still served
    finally:
        c.close()
        s.stop()


def test_without_a_local_socket_the_client_uses_grpc(sock_dir):
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    c = PegaflowClient("unix:" + sock)
    try:
        os.unlink(sock + ".rpc")  # as a server that serves no local socket
        assert c.health().status == "ok"
        assert c.health().status == "ok"
        assert c._local.calls == 0  # both over gRPC
    finally:
        c.close()
        s.stop()


def test_a_slow_call_on_one_thread_does_not_hold_up_another_threads_call(sock_dir):
    """Each thread has its own connection: a Save waiting for its copy (here: a server that
    answers it after 1.5 s) never delays the scheduler's QueryPrefetch on another thread."""
    import struct

    from pegaflow.local_rpc import METHOD_IDS

    base = os.path.join(sock_dir, "slow.sock")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(base + ".rpc")
    lst.listen(8)
    stop = threading.Event()
    head = struct.Struct("<IIB")

    def serve(conn: socket.socket) -> None:
        with conn:
            while not stop.is_set():
                hdr = conn.recv(head.size, socket.MSG_WAITALL)
                if len(hdr) < head.size:
                    return
                n, call_id, method = head.unpack(hdr)
                if n > 5:
                    conn.recv(n - 5, socket.MSG_WAITALL)
                if method == METHOD_IDS["Save"]:
                    time.sleep(1.5)
                conn.sendall(head.pack(5, call_id, 0))  # OK, an empty message

    def accept() -> None:
        lst.settimeout(0.1)
        while not stop.is_set():
            try:
                c, _ = lst.accept()
            except socket.timeout:
                continue
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    c = PegaflowClient("unix:" + base, rpc_timeout_ms=5000, save_timeout_ms=5000)
    try:
        saver = threading.Thread(
            target=lambda: c.save(instance_id="i", tp_rank=0, block_ids=[1], block_hashes=[b"h" * 16])
        )
        saver.start()
        time.sleep(0.2)  # the Save is in flight on the other thread
        t0 = time.monotonic()
        c.health()
        assert time.monotonic() - t0 < 1.0, "the query waited for the other thread's Save"
        saver.join(5)
        assert not saver.is_alive()
    finally:
        c.close()
        stop.set()
        acceptor.join()  # before the close: accept() on a closed socket fails
        lst.close()


def test_a_nowait_send_to_a_server_that_stopped_reading_ends_at_the_calls_deadline(sock_dir):
    """The answer reader reads with a 30 s frame timeout; a send on the same connection once
    inherited it, so a server that answered once and then stopped reading held the engine's
    scheduler for 30 s whatever the call's deadline."""
    from pegaflow.local_rpc import _HEADER, LocalRpc, LocalRpcStatus

    path = os.path.join(sock_dir, "once.sock.rpc")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(1)
    held = []

    def serve() -> None:
        c, _ = lst.accept()
        held.append(c)
        n, call_id, _method = _HEADER.unpack(c.recv(_HEADER.size, socket.MSG_WAITALL))
        c.recv(n - 5, socket.MSG_WAITALL)
        c.sendall(_HEADER.pack(5, call_id, 0))  # one answer, then it reads nothing more

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    rpc = LocalRpc(path, 64 << 20)
    try:
        got = []
        done = threading.Event()
        rpc.call_nowait(2, b"x", 5.0, lambda st, body: (got.append(st), done.set()))
        assert done.wait(5) and got == [0]
        t0 = time.monotonic()
        with pytest.raises(LocalRpcStatus) as ei:
            rpc.call_nowait(2, b"y" * (16 << 20), 0.5, lambda st, body: None)
        assert ei.value.code == 4  # DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 3, f"the send took {time.monotonic() - t0:.1f} s"
    finally:
        rpc.close()
        for c in held:
            c.close()
        lst.close()


def test_nowait_calls_work_in_a_process_with_over_1024_descriptors(sock_dir):
    """The answer reader once waited with select(), which cannot watch a descriptor >= 1024:
    in a busy engine process every nowait call then failed with UNAVAILABLE."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if hard == resource.RLIM_INFINITY else hard, hard))
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    fillers = []
    c = PegaflowClient("unix:" + sock)
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        fillers.append(devnull)
        while fillers[-1] < 1100:
            fillers.append(os.dup(devnull))
        got = []
        done = threading.Event()
        c.load_nowait(
            instance_id="nobody", tp_rank=0, lease_id=b"l" * 16, block_ids=[1], load_state_shm="/x",
            on_done=lambda e: (got.append(e), done.set()),
        )
        assert c._local._asock.fileno() >= 1024
        assert done.wait(5)
        assert got[0] is not None and got[0].code == grpc.StatusCode.INVALID_ARGUMENT, got[0]  # answered
    finally:
        c.close()
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        s.stop()


def _trickling_server(path: str, payload: int, stop: threading.Event):
    """A framed RPC server on `path` that answers its first call with `payload` bytes, one byte
    every 0.2 s, then holds the connection until `stop`: (listener, thread)."""
    from pegaflow.local_rpc import _HEADER

    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(1)

    def serve() -> None:
        c, _ = lst.accept()
        with c:
            n, call_id, _method = _HEADER.unpack(c.recv(_HEADER.size, socket.MSG_WAITALL))
            c.recv(n - 5, socket.MSG_WAITALL)
            answer = _HEADER.pack(5 + payload, call_id, 0) + b"x" * payload
            for i in range(len(answer)):  # one byte at a time
                if stop.wait(0.2):
                    return
                try:
                    c.send(answer[i:i + 1])
                except OSError:
                    return
            stop.wait(10)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lst, t


def test_a_server_trickling_its_answer_cannot_stretch_a_call_past_its_deadline(sock_dir):
    """Each read of an answer gets only what is left of the call's deadline: a server sending a
    byte every 0.2 s once kept a 0.5 s call going for as long as it trickled."""
    from pegaflow.local_rpc import LocalRpc, LocalRpcStatus

    path = os.path.join(sock_dir, "trickle.sock.rpc")
    stop = threading.Event()
    lst, t = _trickling_server(path, 64, stop)
    rpc = LocalRpc(path, 64 << 20)
    try:
        t0 = time.monotonic()
        with pytest.raises(LocalRpcStatus) as ei:
            rpc.call(5, b"", 0.5)
        assert ei.value.code == 4  # DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.5, f"the call took {time.monotonic() - t0:.1f} s"
    finally:
        stop.set()
        rpc.close()
        lst.close()


def test_a_server_trickling_its_answer_cannot_stretch_a_nowait_call_past_its_deadline(sock_dir):
    """The nowait reader read a frame it had begun whole, however slowly it came: a server
    sending a byte every 0.2 s kept a 0.5 s call waiting ~5 s, then answered it OK."""
    from pegaflow.local_rpc import LocalRpc

    path = os.path.join(sock_dir, "trickle.sock.rpc")
    stop = threading.Event()
    lst, t = _trickling_server(path, 16, stop)
    rpc = LocalRpc(path, 64 << 20)
    try:
        got = []
        done = threading.Event()
        t0 = time.monotonic()
        rpc.call_nowait(2, b"x", 0.5, lambda st, body: (got.append((st, time.monotonic() - t0)), done.set()))
        assert done.wait(15)
        status, at = got[0]
        assert status == 4, f"status {status} after {at:.1f} s"  # DEADLINE_EXCEEDED
        assert at < 1.5, f"the nowait call ended after {at:.1f} s"
    finally:
        stop.set()
        rpc.close()
        t.join(5)
        lst.close()


def test_a_late_answer_for_a_call_that_gave_up_is_not_taken_for_a_later_calls(sock_dir):
    """Answers are matched by call id on both call kinds: a server answering 0.4 s late gives
    the answer of a call that already ended at its 0.1 s deadline while a later call waits."""
    from pegaflow.local_rpc import _HEADER, LocalRpc, LocalRpcStatus

    path = os.path.join(sock_dir, "late.sock.rpc")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(4)
    stop = threading.Event()

    def serve(c: socket.socket) -> None:
        with c:
            while True:
                head = c.recv(_HEADER.size, socket.MSG_WAITALL)
                if len(head) < _HEADER.size:
                    return
                n, call_id, _method = _HEADER.unpack(head)
                if n > 5:
                    c.recv(n - 5, socket.MSG_WAITALL)
                body = f"answer of {call_id}".encode()
                threading.Timer(0.4, lambda b=body, i=call_id: _send(c, _HEADER.pack(5 + len(b), i, 0) + b)).start()

    def _send(c: socket.socket, frame: bytes) -> None:
        try:
            c.sendall(frame)
        except OSError:
            pass  # the client dropped that connection

    def accept() -> None:
        lst.settimeout(0.05)
        while not stop.is_set():
            try:
                threading.Thread(target=serve, args=(lst.accept()[0],), daemon=True).start()
            except socket.timeout:
                pass

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    rpc = LocalRpc(path, 64 << 20)
    try:
        # Blocking calls: the first gives up, the second must get its own answer.
        with pytest.raises(LocalRpcStatus) as ei:
            rpc.call(5, b"", 0.1)
        assert ei.value.code == 4
        time.sleep(0.2)
        later = rpc._next_id + 1
        assert rpc.call(5, b"", 2.0) == f"answer of {later}".encode()
        # nowait calls share one connection: the same.
        got: dict = {}
        done = threading.Event()

        def on_done(name: str):
            return lambda st, body: (got.setdefault(name, []).append((st, body)), len(got) == 2 and done.set())

        rpc.call_nowait(2, b"", 0.1, on_done("early"))
        time.sleep(0.3)
        later = rpc._next_id + 1
        rpc.call_nowait(2, b"", 2.0, on_done("later"))
        assert done.wait(5)
        time.sleep(0.3)  # no second callback for either
        assert got["early"] == [(4, b"no answer before the deadline")]
        assert got["later"] == [(0, f"answer of {later}".encode())]
    finally:
        stop.set()
        acceptor.join()
        rpc.close()
        lst.close()


def test_release_nowait_goes_over_the_local_socket_and_answers_like_release(uid, sock_dir):
    sock = os.path.join(sock_dir, "pf.sock")
    s = ServerProc.start(extra=["--uds", sock])
    region, kv = make_kv(2, 16)
    c = PegaflowClient("unix:" + sock)
    try:
        reg = register(c, kv, uid, "ns-" + uid)
        hashes = [bytes([i]) * 16 for i in range(1, 3)]
        fill(kv, [1, 2], hashes)
        c.save(instance_id=uid, tp_rank=0, block_ids=[1, 2], block_hashes=hashes)
        q = c.query_prefetch(instance_id=uid, block_hashes=hashes, request_id="r")
        assert q.hits == 2
        before = c._local.calls
        got = []
        done = threading.Event()
        c.release_nowait(q.lease_id, lambda e: (got.append(e), done.set()))
        assert done.wait(5) and got == [None]
        assert c._local.calls == before + 1, "not sent over the local socket"
        done.clear()
        c.release_nowait(q.lease_id, lambda e: (got.append(e), done.set()))  # released already
        assert done.wait(5) and got[1] is not None
        with pytest.raises(PegaflowError) as ei:
            c.release(q.lease_id)
        assert got[1].code == ei.value.code  # the same refusal as the blocking call
        reg.close()
    finally:
        c.close()
        region.close()
        s.stop()
