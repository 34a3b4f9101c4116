"""libpegaflow.so through ctypes, for the one thing an engine computes on a
request's critical path that C does 3-5x faster than hashlib: the chained
prefix block hashes (`pf_chain_hashes`, one call per prompt).

The library is the server's own (built by `make native`): `$PEGAFLOW_LIB`,
else `<repo>/build/libpegaflow.so` beside this package (a checkout or an
editable install; an installed copy finds it only through $PEGAFLOW_LIB).
Optional: without it `pegaflow.hashes` computes the same bytes with hashlib
(`hash_impl()` says which; a $PEGAFLOW_LIB that does not load is a warning).
`PEGAFLOW_NATIVE_HASH=0` (or false/no/off) forces hashlib (benchmarks compare
the two).
"""

from __future__ import annotations

import array
import ctypes
import logging
import os
import struct
import threading
from typing import List, Optional

from pegaflow.config import env_flag

_log = logging.getLogger("pegaflow.native")
_REPO_LIB = os.path.join(os.path.dirname(__file__), "..", "..", "build", "libpegaflow.so")


class _Lib:
    def __init__(self, lib: ctypes.CDLL) -> None:
        f = lib.pf_chain_hashes
        f.argtypes = [
            ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint32,
            ctypes.c_void_p,
        ]
        f.restype = ctypes.c_int32
        lib.pf_sha256_impl.restype = ctypes.c_char_p
        lib.pf_last_error.argtypes = [ctypes.c_char_p, ctypes.c_uint32]
        self.lib = lib
        self.chain = f
        self.impl = lib.pf_sha256_impl().decode()


_loaded: Optional[_Lib] = None
_tried = False
_lock = threading.Lock()


def library_path() -> str:
    """Where the library is looked for (`$PEGAFLOW_LIB`, else the repo's build/)."""
    return os.environ.get("PEGAFLOW_LIB") or os.path.normpath(_REPO_LIB)


def _lib() -> Optional[_Lib]:
    global _loaded, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        # Raises ValueError naming the variable for a value that is no boolean ("off" used to
        # leave the library in, since only "0" was read as off).
        if env_flag(os.environ, "PEGAFLOW_NATIVE_HASH", True):
            path = library_path()
            try:
                _loaded = _Lib(ctypes.CDLL(path))
            except (OSError, AttributeError) as e:
                # A missing build is normal for a pip-installed client; an old one lacks the symbol.
                # One named by $PEGAFLOW_LIB was asked for: its absence is said where it is seen
                # (an info line is dropped by default logging, and hashlib is 3-5x slower).
                level = logging.WARNING if os.environ.get("PEGAFLOW_LIB") else logging.INFO
                _log.log(level, "pegaflow: block hashes by hashlib (%s not loaded: %s)", path, e)
        _tried = True
        return _loaded


def hash_impl() -> str:
    """What computes the block hashes: "sha-ni" / "portable" (libpegaflow) or "hashlib"."""
    lib = _lib()
    return lib.impl if lib else "hashlib"


def chain_hashes_native(
    parent: bytes, tokens: array.array, block_tokens: int, hash_bytes: int
) -> Optional[List[bytes]]:
    """The chain from `parent` over `tokens` (little-endian u32, whole blocks of
    `block_tokens`, as `pegaflow.hashes` prepares them), or None when the
    library is not loaded (the caller then uses hashlib)."""
    lib = _lib()
    if lib is None:
        return None
    n = len(tokens) // block_tokens
    out = ctypes.create_string_buffer(n * hash_bytes)
    rc = lib.chain(tokens.buffer_info()[0], n, block_tokens, parent, hash_bytes, out)
    if rc != 0:
        msg = ctypes.create_string_buffer(512)
        lib.lib.pf_last_error(msg, len(msg))
        raise ValueError(f"{msg.value.decode(errors='replace')} ({rc})")
    return [h for (h,) in struct.iter_unpack(f"{hash_bytes}s", out)]
