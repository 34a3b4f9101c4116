"""The /dev/shm files this process made and still owns: unlinked when it exits, normally or on
an unhandled exception, so nothing of an engine that never closed them stays in /dev/shm (the
server's own mappings stay valid). A forked child's exit leaves its parent's files alone; a
SIGKILLed process cannot clean up (whoever killed it removes `pegaflow-<kind>-<pid>-*`).
One owner for both kinds of file: host KV regions (regions.py) and load states (load_state.py).

Example:
    own("/dev/shm/pegaflow-kv-1-0-ab")     # made here
    unlink("/dev/shm/pegaflow-kv-1-0-ab")  # closed: gone, and no longer owned
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Dict

_lock = threading.Lock()
#: path → the pid of the process that made it.
_owned: Dict[str, int] = {}


def own(path: str) -> None:
    """`path` was made by this process: unlinked at its exit unless `unlink`ed before."""
    with _lock:
        _owned[path] = os.getpid()


def unlink(path: str) -> None:
    """Unlinks `path` (a missing file is fine; every mapping of it stays valid), and forgets it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with _lock:
        _owned.pop(path, None)


@atexit.register
def _unlink_at_exit() -> None:
    me = os.getpid()
    with _lock:
        left = [p for p, pid in _owned.items() if pid == me]
    for path in left:
        unlink(path)
