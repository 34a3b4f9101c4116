"""Errors the engines' side raises.

`PegaflowError` is a failed RPC (the gRPC status code, the server's message
and the method), `PegaflowLoadError` a load whose load state ended in
failure (the negative state code), `PegaflowLoadTimeout` a wait that ran
past its deadline. The connector never lets any of them reach the engine's
step: it turns them into misses, dropped saves and recomputed blocks.
"""

from __future__ import annotations

import grpc


class PegaflowError(Exception):
    """A failed call: `code` (a `grpc.StatusCode`), `details` (the server's
    message, which names the ids involved) and `method` (e.g. "Save").

    Example:
        try:
            client.load(...)
        except PegaflowError as e:
            if e.code == grpc.StatusCode.FAILED_PRECONDITION: ...
    """

    def __init__(self, code: grpc.StatusCode, details: str, method: str):
        self.code = code
        self.details = details
        self.method = method
        super().__init__(f"{method}: {code.name}: {details}")

    @property
    def code_name(self) -> str:
        return self.code.name


class PegaflowLoadError(Exception):
    """A load that the server (or the native copy) marked failed: `state` is
    the negative code from the load state (-1000 = refused before any copy).
    The blocks it targeted hold no valid KV and must be recomputed."""

    def __init__(self, state: int, message: str):
        self.state = state
        super().__init__(message)


class PegaflowLoadTimeout(PegaflowLoadError, TimeoutError):
    """A wait on a load state ran past its deadline (state still pending)."""

    def __init__(self, message: str):
        super().__init__(0, message)
