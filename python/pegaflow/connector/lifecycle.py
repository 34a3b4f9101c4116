"""Facts about a load's life that every issuer (worker, scheduler, query) shares."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional

import grpc

from ..client import CallNotSent
from ..errors import PegaflowError
from ..load_state import LoadState
from ..load_state import unlink as _unlink_state

if TYPE_CHECKING:  # pragma: no cover
    from ..client import PegaflowClient

log = logging.getLogger("pegaflow.connector")

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


def maybe_accepted(e: PegaflowError) -> bool:
    """Whether the failed call (a Load, a query that carried loads) may have reached the server,
    whose copy may then still run: a MAYBE_ACCEPTED status, unless the client knows it never
    left this process (CallNotSent: no server could be reached). A Load sent while no server was
    up once held its request's blocks, and a probe's staging run, for 3 load timeouts."""
    return e.code in MAYBE_ACCEPTED and not isinstance(e, CallNotSent)


#: The state a Load's sender writes when the Load ended with a MAYBE_ACCEPTED status (its answer
#: was lost): the load failed for the engine (its blocks are recomputed), but the server may
#: still copy into them. A worker holds what that copy may write (the request's blocks, the
#: staging run) until the server settles the state (a Load that arrives resets it, then ends
#: it) or LINGER_LOAD_TIMEOUTS pass. Not a code the server writes (those are PF statuses and
#: -1000, a refusal).
STATE_ANSWER_LOST = -1001


def give_lease_back(client: "PegaflowClient", lease_id: bytes, request_id: str) -> bool:
    """A rank will not load from `lease_id` (its Load was refused, or never sent): the lease goes
    back now rather than pinning its blocks until its TTL (10 minutes by default). Without
    waiting for the answer; a failure is only logged. True when the release was sent."""

    def done(e: Optional[PegaflowError]) -> None:
        if e is not None:
            log.debug("request %s: giving its lease back failed: %s", request_id, e)

    try:
        client.release_nowait(lease_id, done)
        return True
    except PegaflowError as e:
        done(e)
        return False


def unlink_shm(name: str) -> None:
    """Unlinks a load state's name (every mapping of it stays valid)."""
    _unlink_state(name)  # also drops it from what the process unlinks at exit


class FreshStates:
    """Load states made ahead, between steps, so an issuer does not create them (a shm file,
    ~50-200 µs each) on a warm request's way to the server. Each is used by one load; its name
    is unlinked by the issuer's bookkeeping (they are handed over), or by `close` if unused.

    Example:
        fresh = FreshStates(2)       # two ranks
        a, b = fresh.take(2)         # in the probe / after allocation
        fresh.refill()               # between steps
    """

    def __init__(self, per_load: int):
        self.per_load = per_load
        self._spare: List[LoadState] = []
        self.refill()

    def refill(self) -> None:
        while len(self._spare) < self.per_load:
            self._make()

    def take(self, n: int) -> List[LoadState]:
        while len(self._spare) < n:
            self._make()
        taken, self._spare = self._spare[:n], self._spare[n:]
        return taken

    def _make(self) -> None:
        st = LoadState.create()
        st.hand_over()  # the issuer unlinks the name once nobody needs it any more
        self._spare.append(st)

    @property
    def names(self) -> List[str]:
        """The spare states' names (made, not yet used)."""
        return [st.name for st in self._spare]

    def close(self) -> None:
        for st in self._spare:
            st.close()
            unlink_shm(st.name)
        self._spare = []
