"""The embedded runner's errors: what stops it, with what a person needs to act on it.

::

    ShopperError                       prompt_assembly.errors
    └── RunnerError                    the embedded runner cannot go on
        ├── ConsumerFailed             a Kafka consumer error no retry can fix: a fatal error, a
        │                              refused login or TLS handshake, a missing topic, a
        │                              repartition topic that cannot be made (``runner.repartition``)
        ├── DeadLettersUndelivered     the DLQ took no delivery for ``sink_retry.max_wait_s``
        ├── RekeyUndelivered           an event re-keyed by shopper id was not delivered to the
        │                              repartition topic (``runner.repartition``)
        ├── SessionStoreUnavailable    the session store (Redis) answered no load for
        │                              ``sink_retry.max_wait_s``
        └── OwnershipLost              a session save refused for partitions this member still
                                       holds (``runner.ownership``)

A sink that stays down past ``sink_retry`` stops the runner with the store's own error (a restart
replays from the last commit); the session store's loads, which the poll loop waits on, are translated
into ``SessionStoreUnavailable``, whose message is the one line an operator needs.
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


class RekeyUndelivered(RunnerError):
    """A copy of a mis-keyed event, keyed by its shopper id, was refused by the repartition topic or not
    acknowledged within ``sink_retry.max_wait_s``: the runner stops without committing past its
    original, and a restart replays the original and produces the copy again."""


class SessionStoreUnavailable(RunnerError):
    """A session or timer load from Redis failed for longer than ``sink_retry.max_wait_s``: the
    runner stops without committing past the records that needed it, and a restart replays them.

    ``what`` is the load (``session load``, ``timer load``), ``waited_s`` how long it was retried,
    ``cause`` the last error's type and message."""

    def __init__(self, what: str, waited_s: float, cause: BaseException) -> None:
        reason = " ".join(str(cause).split()) or type(cause).__name__
        super().__init__(
            f"{what} from Redis failed for {waited_s:.0f} s (sink_retry.max_wait_s), last error "
            f"{type(cause).__name__}: {reason[:200]}; check that Redis (RUNNER_SINKS__REDIS_URL or "
            "SINK_REDIS_URL) is up; nothing past the last commit was committed, a restart replays it"
        )
        self.what = what
        self.waited_s = waited_s


class OwnershipLost(RunnerError):
    """Redis refused a session save for partitions this member's lease still holds: another member
    took them (this one was dropped from the group without a revoke yet), or Redis went back to an
    older token (restored from a snapshot, a failover). Going on would drop every durable point and
    commit nothing, and sessions evicted meanwhile would come back older; the runner stops instead,
    and a restart rejoins the group, takes its partitions' tokens again and replays from the last
    commit."""

    def __init__(self, partitions: list[int]) -> None:
        super().__init__(
            f"session saves for partitions {partitions} were refused while this member holds them: another "
            "member took them, or Redis lost or rolled back their owner tokens; stopping so that a restart "
            "rejoins the group and replays from the last commit"
        )
        self.partitions = partitions
