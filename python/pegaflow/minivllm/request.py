"""A request as vLLM's scheduler sees it (mirrors `vllm/v1/request.py`), with chained block hashes.

Block hashes: block i's hash covers its `block_size` tokens and, through block i-1's hash,
every token before it, so equal hashes mean equal prefixes — the key a content-addressed
KV store needs. vLLM computes `hash_fn((parent_hash, block_tokens, extra_keys))` from a
`NONE_HASH` that is random per process unless PYTHONHASHSEED is fixed; a store shared by
processes, restarts and nodes needs the same hashes everywhere, so here the seed is fixed:
`NONE_HASH = sha256(b"pegaflow-root:" + salt)`, and block i's hash is
`sha256(hash[i-1] || block tokens as u32 little-endian)`, each truncated to 16 bytes. This is
byte-for-byte the scheme of `lib/client/hashes.ts` and `pegaflow.hashes` (which own it), so
every client agrees on keys.

Example:
    >>> r = Request("r0", list(range(40)), block_size=16)
    >>> len(r.block_hashes), r.num_tokens
    (2, 40)
"""

from __future__ import annotations

import time

from pegaflow.connector.vllm_api import RequestStatus
from pegaflow.hashes import chain_hashes, root_hash

__all__ = ["Request", "RequestStatus"]


class Request:
    """One generation request: its tokens, progress, status and block hashes.

    `num_computed_tokens` counts tokens whose KV is in the paged cache (or is being loaded
    into it); the scheduler advances it when it schedules tokens, exactly like vLLM.

    No `num_publishable_block_hashes`: every full block's hash here is final, and a connector
    saves a block after the step that computes it. (It once returned the full blocks of
    `num_computed_tokens`, which at `build_connector_meta` does not count the step being built
    yet: each step's blocks were saved a step late, and a request's last step's never.)
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int = 1,
        block_size: int = 16,
        eos_token_id: int | None = None,
        hash_salt: str = "",
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids is empty")
        if max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens found computed (local prefix cache + connector) when first scheduled; -1 until then.
        self.num_cached_tokens = -1
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        self.kv_transfer_params: dict | None = None
        self.sampling_params = None
        self.pooling_params = None
        self.lora_request = None
        self.mm_features: list = []
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self._hash_salt = hash_salt
        self.block_hashes: list[bytes] = []
        self.update_block_hashes()

    # ------------------------------------------------------------------ tokens

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return list(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._output_token_ids.extend(ids)
        self._all_token_ids.extend(ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend `block_hashes` over blocks that became full (vLLM's `get_request_block_hasher`)."""
        bs = self.block_size
        first, end = len(self.block_hashes), self.num_tokens // bs
        if end <= first:
            return
        prev = self.block_hashes[-1] if self.block_hashes else root_hash(self._hash_salt)
        # One call for every new block (a 10K-token prompt's 640 are on the TTFT clock).
        self.block_hashes.extend(chain_hashes(prev, self._all_token_ids[first * bs : end * bs], bs))

    # ------------------------------------------------------------------ status

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def check_stop(self, max_model_len: int | None = None) -> bool:
        """Set a FINISHED status when the last token ends the request (vLLM's `check_stop`):
        EOS, `max_tokens` outputs, or `max_model_len` tokens in all (no position past it)."""
        if self._output_token_ids and self._output_token_ids[-1] == self.eos_token_id:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if self.num_output_tokens >= self.max_tokens or (
            max_model_len is not None and self.num_tokens >= max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
