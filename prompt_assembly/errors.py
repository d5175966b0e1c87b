"""The project's one error hierarchy: every error that crosses a package boundary is a ``ShopperError``.

It lives in the bottom layer so that every package can subclass it; each package keeps its own errors
in its own ``errors.py`` (or next to the one gate that raises them), and this docstring draws the whole
tree, the way ``httpx/_exceptions.py`` does::

    ShopperError                                  prompt_assembly.errors (this module)
    ├── MalformedEvent                            prompt_assembly.events: bytes that are no shopper event
    ├── ConfigurationError                        a setting that cannot work; raised at start, not later
    │   └── InsecureConfiguration                 pipeline.kafka_security: a secret on a plaintext protocol
    ├── LLMError                                  llm_client.errors: a call to a replica failed
    │   ├── TransportError  (retryable)           the replica could not be reached or broke off
    │   │   ├── EndpointUnavailable               refused/reset, a 5xx or 429, a truncated answer
    │   │   └── AttemptTimeout                    one attempt ran past its share of the deadline
    │   ├── InvalidAnswer   (retryable once)      the replica answered 200, but not with a usable answer
    │   │   └── AnswerTooLarge                    ... an answer over ``max_answer_bytes``
    │   ├── NoHealthyEndpoint (retryable)         every replica is ejected or drained
    │   ├── DeadlineExceeded                      the whole call ran past its deadline, slot wait included
    │   ├── RetryBudgetExhausted                  retries are capped so an outage does not multiply load
    │   └── BadRequest                            a 4xx: the request itself is wrong
    ├── BatchError                                batch.errors: a product-understanding job cannot go on
    ├── MatchClientError                          realtime.client: the matching API refused or failed
    ├── StackError                                devstack: an embedded service could not be started
    └── ... each further package adds its own subclass here and in this drawing

Built-in exceptions (``ValueError``, ``RuntimeError``, ``TypeError``) stay inside the package that
raised them: a package boundary translates them into one of the classes above, with what a person needs
to act (which replica, which setting, which record). Subclasses that used to be a ``ValueError`` keep it
as a second base, so existing ``except ValueError`` callers keep working.
"""

from __future__ import annotations


class ShopperError(Exception):
    """Base of every error this project raises across a package boundary."""


class ConfigurationError(ShopperError, ValueError):
    """A setting that cannot work (an empty endpoint list, a secret on a plaintext protocol, ...).

    Raised when the settings are read, so that a wrong deployment fails at start with the setting's
    name, instead of later with a symptom."""
