"""Facts about a load's life that every issuer (worker, scheduler, query) shares."""

from __future__ import annotations

import os

import grpc

#: A load that timed out keeps what it may still write into (its request's blocks, or a
#: staging run) held until the server settles its state, or this many load timeouts after it
#: started (a server that died never will; its copies died with it).
LINGER_LOAD_TIMEOUTS = 3

#: Status codes after which a Load (or a query that carried loads) may still have reached the
#: server: its copy may still run.
MAYBE_ACCEPTED = (
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
)


def unlink_shm(name: str) -> None:
    """Unlinks a load state's name (every mapping of it stays valid)."""
    try:
        os.unlink("/dev/shm" + name)
    except FileNotFoundError:
        pass
