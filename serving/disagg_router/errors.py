"""The stand-in's errors. Each one ends the request with 500, as ``trtllm-serve disaggregated`` answers
every failure past request validation (``Internal server error ...``); the message says which step and
which server failed, so a person can act on it::

    DisaggError
    ├── NoServerAvailable      a pool is empty, or its only server was excluded
    ├── RouterRefusal          the router cannot count this request's load (use_tokens on a chat request)
    ├── UpstreamError          a context or generation server failed or answered an error
    └── BadContextResponse     a context server answered without usable disaggregated_params
"""

from __future__ import annotations

from prompt_assembly.errors import ShopperError


class DisaggError(ShopperError, RuntimeError):
    """Base of the stand-in's request errors."""


class NoServerAvailable(DisaggError):
    """No server left to pick (TensorRT-LLM: ``No available servers after excluding ...``)."""


class RouterRefusal(DisaggError, ValueError):
    """The router raises on this request, as TensorRT-LLM's does (``LoadBalancing router with tokens
    doesn't support ChatCompletionRequest yet``); a configuration with ``use_tokens`` hits it."""


class UpstreamError(DisaggError):
    """A worker could not be reached, or answered a non-200 status (``status`` 0: no answer)."""

    def __init__(self, server: str, status: int, detail: str) -> None:
        super().__init__(f"{server} answered {status}: {detail}" if status else f"{server}: {detail}")
        self.server = server
        self.status = status


class BadContextResponse(DisaggError):
    """A context server's answer lacks one choice with ``disaggregated_params.ctx_request_id``."""
