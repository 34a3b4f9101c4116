"""Scheduler side of load_issuer "query": the Load rides on the QueryPrefetch.

With staging blocks (staging.py) a layer-wise load's targets exist before the engine allocates
the request's blocks: a run of the staging room. So the probe itself names that run and every
rank's load state (`QueryPrefetch.load_into`), and the server starts the hit's copy before it
answers. The copy then starts before the scheduler has even allocated, instead of one
answer, one allocation and one more RPC later (about 2 ms on the H100 for a 10K-token prefix).

Life of a run (held in the StagingRoom under the request id):
  probe    hold a run of the asked size, create one load state per rank, query with both.
           Miss / "loading" / refused before any load: the run and states go at once. A hit:
           the run shrinks to the hit; every rank's copy is running.
  claim    update_state_after_alloc: the run becomes a run of the step being built; the
           intent carries the state names, each worker attaches (as for the scheduler issuer).
           The run stays held until every state settled (or LINGER_LOAD_TIMEOUTS load timeouts
           passed): a copy the worker timed out on may still land in it, and a later probe's copy
           into the same blocks, claimed once the worker saw the late one settle, would be
           scattered with the late copy's bytes.
  drop     the probe is not used (it drifted, the request ended, a rank's load was refused)
           or the query failed in a way that may have reached the server: the run drains —
           held until every state settled (or LINGER_LOAD_TIMEOUTS load timeouts passed:
           a server that died never settles), so no late byte lands in a reused run.

Same safety rule as the scheduler issuer: the engine schedules one step at a time (the
previous step's scatters out of the staging room finished before the scheduler runs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..client import PegaflowClient, QueryResult
from ..errors import PegaflowError
from ..load_state import LoadState
from .lifecycle import LINGER_LOAD_TIMEOUTS, FreshStates, maybe_accepted, unlink_shm
from .staging import StagingRoom

log = logging.getLogger("pegaflow.connector")

Rank = Tuple[int, int]


@dataclass
class EarlyLoad:
    """A probe's load already running into staging blocks [first, first + hits)."""

    first: int
    hits: int
    states: Dict[Rank, LoadState]

    @property
    def names(self) -> Dict[Rank, str]:
        return {r: st.name for r, st in self.states.items()}


@dataclass
class _Drain:
    states: List[LoadState]
    until: float


class QueryIssuer:
    """Probes that start their loads (see the module doc). `count(key, n)` records stats.

    Example:
        qi = QueryIssuer(client, room, ranks=[(0, 0)], load_timeout_s=10.0, count=stats.add,
                         fresh=FreshStates(1))
        q, early = qi.query("req-7", "inst.staging", hashes)   # early: the copy is running
        first, n = qi.claim("req-7", early)                     # in update_state_after_alloc
    """

    def __init__(
        self,
        client: PegaflowClient,
        room: StagingRoom,
        *,
        ranks: Sequence[Rank],
        load_timeout_s: float,
        count: Callable[[str, int], None],
        fresh: FreshStates,
    ):
        # Every probe carries the client's engine_id: the server refuses another engine's under
        # this instance id.
        self.client = client
        self.room = room
        self.ranks = list(ranks)
        self.load_timeout_s = load_timeout_s
        self._count = count
        self._drains: Dict[Tuple[str, int], _Drain] = {}
        self._serial = 0
        self._fresh = fresh

    def query(self, rid: str, instance_id: str, hashes: Sequence[bytes]) -> Tuple[QueryResult, Optional[EarlyLoad]]:
        """QueryPrefetch with the load of every rank into a held run of `len(hashes)` blocks
        (the caller sized it with `room.offer`). Raises PegaflowError like query_prefetch."""
        first = self.room.hold(rid, len(hashes))
        states = dict(zip(self.ranks, self._fresh.take(len(self.ranks))))
        try:
            q = self.client.query_prefetch(
                instance_id=instance_id, block_hashes=hashes, request_id=rid,
                load_into=range(first, first + len(hashes)), load_states={r: st.name for r, st in states.items()},
            )
        except PegaflowError as e:
            if maybe_accepted(e):
                self._drain(rid, states)
            else:  # refused before any load: nothing will ever write the run
                self._discard(rid, states)
            raise
        if q.loading or q.hits == 0:
            self._discard(rid, states)
            return q, None
        if q.load_errors:
            self._count("query_load_errors", 1)
            log.warning("request %s: query-and-load refused (%d blocks recomputed): %s",
                        rid, q.hits, "; ".join(q.load_errors))
            self._drain(rid, states)
            return QueryResult(loading=False), None
        self.room.shrink(rid, q.hits)
        self._count("query_loads", 1)
        return q, EarlyLoad(first, q.hits, states)

    def claim(self, rid: str, early: EarlyLoad) -> Tuple[int, int]:
        """The probe's run joins the step being built; the workers attach to its states (the
        names stay linked for them: the caller's bookkeeping unlinks them once the step ran). It
        stays held, as a drained run, until its copies settled (see the module doc)."""
        self._serial += 1
        key = (rid, self._serial)
        ran = self.room.claim(rid, keep_as=key)
        until = time.monotonic() + self.load_timeout_s * LINGER_LOAD_TIMEOUTS
        self._drains[key] = _Drain(list(early.states.values()), until)
        return ran

    def drop(self, rid: str, early: EarlyLoad) -> None:
        """An unused probe: its run drains until its copies settled."""
        self._count("query_loads_dropped", 1)
        self._drain(rid, early.states)

    def _discard(self, rid: str, states: Dict[Rank, LoadState]) -> None:
        self.room.release(rid)
        for st in states.values():
            st.close()
            unlink_shm(st.name)

    def _drain(self, rid: str, states: Dict[Rank, LoadState]) -> None:
        """Moves `rid`'s run to a drain key (the request may probe again under its id)."""
        self._serial += 1
        key = (rid, self._serial)
        self.room.rekey(rid, key)
        for st in states.values():
            unlink_shm(st.name)  # the server holds its own mapping; no worker will attach
        self._drains[key] = _Drain(list(states.values()), time.monotonic() + self.load_timeout_s * LINGER_LOAD_TIMEOUTS)

    def poll(self) -> None:
        """Gives back every drained run whose copies settled (or that waited long enough): from
        build_step, and before a probe sizes its run with `room.offer`."""
        if not self._drains:
            return
        now = time.monotonic()
        for key in list(self._drains):
            d = self._drains[key]
            settled = all(st.poll() is not None for st in d.states)
            if not settled and now < d.until:
                continue
            if not settled:
                self._count("query_loads_abandoned", 1)
                log.warning("request %s: a query-issued load is still pending %d load timeouts later; its "
                            "staging blocks are reused", key[0], LINGER_LOAD_TIMEOUTS)
            for st in d.states:
                st.close()
            self.room.release(key)
            del self._drains[key]

    @property
    def draining(self) -> int:
        return len(self._drains)

    def close(self) -> None:
        for key, d in self._drains.items():
            for st in d.states:
                st.close()
            self.room.release(key)
        self._drains.clear()
