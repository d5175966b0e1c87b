"""Disaggregated serving, the pure parts: the context replica's ``opaque_state``, the first token it
hands over, what a transfer moves, and the error a generation replica's client can recover from.

TensorRT-LLM splits a request over two servers behind ``trtllm-serve disaggregated``
(``serving/trtllm/disagg/``): a *context* server computes the prompt's KV cache and the first token for a
``context_only`` request (``max_tokens`` forced to 1, never streamed) and answers with
``disaggregated_params`` (``first_gen_tokens``, ``ctx_request_id``, ``opaque_state``); the front end then
sends the original request with those params as ``generation_only`` to a *generation* server, whose cache
transceiver pulls the KV cache from the context server and decodes the rest. The simulator's roles
(``SimulatorConfig.role``) follow that protocol over HTTP; the pull is ``POST /internal/kv_transfer`` on
the context replica (a real transceiver talks UCX or NIXL, not HTTP).

Guarantees:

- a context replica keeps a finished ``context_only`` prompt's blocks pinned (never evicted) until a
  generation replica pulls them or ``kv_transfer_timeout_s`` passes; after that a pull gets
  ``KvCacheGone`` (404 ``kv_cache_gone``), and the generation replica answers its client 409
  ``kv_cache_gone``: the client redoes the prefill, nothing else is lost;
- a generation replica pulls only the blocks its own prefix cache lacks (a shopper's next request moves
  only its new blocks), and the partial last block, which is never a cached block, always moves.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from prompt_assembly.errors import ShopperError
from prompt_assembly.tokens import token_ids

KV_CACHE_GONE = "kv_cache_gone"
"""Error type of a request whose KV cache the context replica no longer holds: redo the prefill."""


class KvCacheGone(ShopperError, LookupError):
    """The context replica does not hold this ``ctx_request_id`` any more (pulled already, timed out,
    or a restart lost it). Retrying the pull cannot help; redoing the prefill can."""


class KvTransferFailed(ShopperError, ConnectionError):
    """The context replica could not be reached or answered something unexpected; its KV cache is as
    good as gone for this request (``kv_cache_gone``: redo the prefill, perhaps on another replica)."""


class OpaqueState(BaseModel):
    """What the simulator puts in ``disaggregated_params.opaque_state``: where and what to pull.
    On the wire: base64 of its JSON, as TensorRT-LLM's own opaque state is base64 of engine bytes."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    ctx_url: str
    ctx_request_id: int
    block_hashes_count: int

    def encode(self) -> str:
        return base64.b64encode(orjson.dumps(self.model_dump())).decode()

    @classmethod
    def decode(cls, text: str) -> OpaqueState:
        """Raises ``ValueError`` with a readable reason for anything this simulator did not write."""
        try:
            return cls.model_validate(orjson.loads(base64.b64decode(text, validate=True)))
        except (binascii.Error, orjson.JSONDecodeError, ValidationError) as exc:
            raise ValueError(f"opaque_state is not a simulator context replica's state: {exc}") from exc


def first_gen_token(piece: str) -> int:
    """The token id of the answer's first piece, as ``first_gen_tokens`` carries it."""
    ids = token_ids(piece)
    return ids[0] if ids else 0


def blocks_to_send(requested: int, prompt_tokens: int, block_size: int) -> int:
    """KV blocks one transfer moves: the full blocks asked for plus the prompt's partial last block
    (it has no hash, so no cache holds it, and the puller always needs it)."""
    return requested + (1 if prompt_tokens % block_size else 0)


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    return math.ceil(prompt_tokens / block_size)


@dataclass(frozen=True, slots=True)
class TransferReceipt:
    """What one pull moved: blocks, bytes, and the modelled transfer time (simulated ms)."""

    ctx_request_id: int
    blocks: int
    bytes: int
    transfer_ms: float
