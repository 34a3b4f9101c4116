"""Waiting for a condition in the tests: the one helper they share."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(cond: Callable[[], object], what: str, timeout_s: float = 30.0, every_s: float = 0.02) -> None:
    """Polls `cond` every `every_s` until it is truthy; AssertionError naming `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)
