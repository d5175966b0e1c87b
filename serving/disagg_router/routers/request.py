"""What a router reads of one OpenAI request: its prompt's token ids and block hashes, and the load it
adds to a server.

Block hashes follow the layout of TensorRT-LLM's ``BlockHashMixin._compute_block_hashes``: blocks of
``tokens_per_block`` over every token but the last ("in KvCacheManager, the last token is not included
in the block key"), the last block partial when the count does not divide. The hash *function* is the
simulated engine's (``serving.simulator.block_keys.engine_block_hashes``, salted per ``cache_salt``),
because those are the hashes its KV cache events carry, as TensorRT-LLM's router hashes token ids with
the engine's own block hash. The
simulator stores full blocks only, so a partial block stands as ``PARTIAL_BLOCK``, which no server's
table holds: it counts in the prompt's length (``padded_tokens``) and never matches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from prompt_assembly.tokens import token_ids
from serving.disagg_router.errors import RouterRefusal
from serving.simulator.block_keys import engine_block_hashes
from serving.simulator.protocol import ChatCompletionRequest, CompletionRequest, RequestType

PARTIAL_BLOCK = -1
"""The hash of a prompt's partial last block: never an xxh64 digest, so never in a block table."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request as the routers see it. ``request_type`` is what the request carries when the
    router is asked (``context_only`` for a context server, ``generation_only`` for a generation server
    after a remote prefill, None for an ordinary request)."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    request_type: RequestType | None = None
    completion_prompt_length: int | None = None
    """``len(prompt)`` of a completion request: characters of a string prompt, as TensorRT-LLM's
    ``get_request_num_tokens`` counts it (it counts tokens only once a router replaced the string by
    token ids); None for a chat request."""

    @classmethod
    def of(cls, body: ChatCompletionRequest | CompletionRequest) -> RouteRequest:
        """The prompt tokenised and salted as the simulator's servers do it, so hashes match."""
        length = len(body.prompt_text()) if isinstance(body, CompletionRequest) else None
        return cls(token_ids(body.prompt_text()), body.cache_salt, None, length)

    def as_type(self, request_type: RequestType | None) -> RouteRequest:
        return dataclasses.replace(self, request_type=request_type)

    @property
    def prompt_tokens(self) -> int:
        """``total_length`` of the conditional rule: every token of the prompt."""
        return len(self.token_ids)

    def load_tokens(self) -> int:
        """TensorRT-LLM's ``get_request_num_tokens``, refusals included (only ``use_tokens`` asks)."""
        if self.request_type in (None, "context_only"):
            if self.completion_prompt_length is None:
                raise RouterRefusal(
                    "LoadBalancing router with tokens doesn't support ChatCompletionRequest yet"
                )
            return self.completion_prompt_length
        if self.request_type == "generation_only":
            raise RouterRefusal("LoadBalancing router with tokens doesn't support generation_only requests")
        raise RouterRefusal(f"Unsupported request type: {self.request_type}")


def block_hashes(request: RouteRequest, tokens_per_block: int) -> list[int]:
    """The prompt's block hashes in TensorRT-LLM's layout (see the module's docstring)."""
    keyed = list(request.token_ids[:-1])
    full = engine_block_hashes(keyed, tokens_per_block, request.cache_salt)
    return [*full, PARTIAL_BLOCK] if len(keyed) % tokens_per_block else full
