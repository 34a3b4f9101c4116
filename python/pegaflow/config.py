"""Client settings: every knob has a constructor argument, a `PEGAFLOW_*`
environment variable and a default, resolved here once (argument > env >
default). A bad value raises ValueError naming the variable.

    PEGAFLOW_ADDR               server address, "host:port" or "unix:/path"   127.0.0.1:50055
    PEGAFLOW_RPC_TIMEOUT_MS     deadline of every unary call but Save          5000
    PEGAFLOW_SAVE_TIMEOUT_MS    deadline of Save (it returns after the copy)   30000
    PEGAFLOW_LOAD_TIMEOUT_MS    longest wait on a load state                    60000
    PEGAFLOW_RECONNECT_MAX_MS   cap of the re-registration backoff             5000
    PEGAFLOW_KEEPALIVE_MS       HTTP/2 keepalive ping interval                 30000
    PEGAFLOW_LOCAL_RPC          with a unix: address, send the hot calls over   1
                                the server's local RPC socket (PATH.rpc); 0 = gRPC only
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from pegaflow.local_rpc import LOCAL_RPC_SUFFIX

DEFAULT_ADDR = "127.0.0.1:50055"
#: The largest millisecond setting: gRPC's channel arguments (keepalive, reconnect backoff) and
#: poll() timeouts are C ints; a larger value made every call raise OverflowError.
MAX_MS = 2**31 - 1
#: The server's default message limit (lib/server/config.ts DEFAULT_MAX_MESSAGE).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _ms(name: str, raw: object) -> int:
    """`raw` as a number of milliseconds in 1..MAX_MS, else ValueError naming `name`."""
    try:
        v = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        raise ValueError(f"{name}={raw!r} is not an integer number of milliseconds") from None
    if not 0 < v <= MAX_MS:
        raise ValueError(f"{name}={raw!r} must be in 1..{MAX_MS} (milliseconds)")
    return v


def _env_ms(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    return _ms(name, raw)


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """`env[name]` as a boolean (1/0, true/false, yes/no, on/off; unset or empty = `default`),
    else ValueError naming the variable.

    Example:
        env_flag({"PEGAFLOW_LOCAL_RPC": "off"}, "PEGAFLOW_LOCAL_RPC", True)   # False
    """
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")


def check_address(addr: str) -> str:
    """Returns `addr` if it is "host:port" or "unix:/abs/path" (gRPC's own
    target syntax for a Unix socket), else raises ValueError."""
    if addr.startswith("unix:"):
        path = addr[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise ValueError(f"address {addr!r}: a Unix socket address is unix:/absolute/path")
        return addr
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {addr!r} is not host:port (e.g. 127.0.0.1:50055) or unix:/path")
    return addr


@dataclass(frozen=True)
class ClientConfig:
    """Resolved client settings (see the module doc for the variables).

    Example:
        cfg = ClientConfig.resolve(addr="unix:/run/pegaflow.sock")
    """

    addr: str = DEFAULT_ADDR
    rpc_timeout_s: float = 5.0
    save_timeout_s: float = 30.0
    load_timeout_s: float = 60.0
    reconnect_max_s: float = 5.0
    keepalive_s: float = 30.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    local_rpc: bool = True

    @classmethod
    def resolve(
        cls,
        addr: Optional[str] = None,
        rpc_timeout_ms: Optional[int] = None,
        save_timeout_ms: Optional[int] = None,
        load_timeout_ms: Optional[int] = None,
        reconnect_max_ms: Optional[int] = None,
        keepalive_ms: Optional[int] = None,
        local_rpc: Optional[bool] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> "ClientConfig":
        e = os.environ if env is None else env

        def pick(arg: Optional[int], name: str, default: int) -> float:
            if arg is not None:
                return _ms(name.lower(), arg) / 1000.0
            return _env_ms(e, "PEGAFLOW_" + name, default) / 1000.0

        if addr:
            where = addr
        elif e.get("PEGAFLOW_ADDR"):
            try:
                where = check_address(e["PEGAFLOW_ADDR"])
            except ValueError as err:
                raise ValueError(f"PEGAFLOW_ADDR: {err}") from None
        else:
            where = DEFAULT_ADDR

        return cls(
            addr=check_address(where),
            rpc_timeout_s=pick(rpc_timeout_ms, "RPC_TIMEOUT_MS", 5000),
            save_timeout_s=pick(save_timeout_ms, "SAVE_TIMEOUT_MS", 30000),
            load_timeout_s=pick(load_timeout_ms, "LOAD_TIMEOUT_MS", 60000),
            reconnect_max_s=pick(reconnect_max_ms, "RECONNECT_MAX_MS", 5000),
            keepalive_s=pick(keepalive_ms, "KEEPALIVE_MS", 30000),
            local_rpc=local_rpc if local_rpc is not None else env_flag(e, "PEGAFLOW_LOCAL_RPC", True),
        )

    def local_rpc_path(self) -> Optional[str]:
        """The server's local RPC socket beside a unix: address, when enabled."""
        if not self.local_rpc or not self.addr.startswith("unix:"):
            return None
        path = self.addr[len("unix:"):]
        return (path[2:] if path.startswith("//") else path) + LOCAL_RPC_SUFFIX
