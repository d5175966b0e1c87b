"""The embedded runner's errors: what stops it, with what a person needs to act on it.

::

    ShopperError                       prompt_assembly.errors
    └── RunnerError                    the embedded runner cannot go on
        ├── ConsumerFailed             a Kafka consumer error no retry can fix: a fatal error, a
        │                              refused login or TLS handshake, a missing topic
        └── DeadLettersUndelivered     the DLQ took no delivery for ``sink_retry.max_wait_s``

A store that stays down past ``sink_retry`` stops the runner with the store's own error (a restart
replays from the last commit); those are not translated here.
"""

from __future__ import annotations

from prompt_assembly.errors import ShopperError


class RunnerError(ShopperError):
    """The embedded runner stopped; nothing past the last durable point was committed."""


class ConsumerFailed(RunnerError):
    """The consumer met an error that waiting cannot fix (``runner.consumer_errors.classify``).

    ``code`` is librdkafka's error name (``TOPIC_AUTHORIZATION_FAILED``, ``_SSL``, ...), ``setting``
    the runner setting (environment variable) to check, ``topic`` the topic concerned, if any."""

    def __init__(
        self, message: str, *, code: str, setting: str | None = None, topic: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.setting = setting
        self.topic = topic


class DeadLettersUndelivered(RunnerError):
    """Dead letters stayed in the producer's queue past ``sink_retry.max_wait_s``: the runner stops
    without committing past them, and a restart replays them."""
