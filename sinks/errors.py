"""Errors of the result sinks (see the tree in ``prompt_assembly.errors``)."""

from __future__ import annotations

from prompt_assembly.errors import ShopperError
from sinks.config import shown_endpoint


class SinkError(ShopperError):
    """A sink could not make results durable. Engines retry it under ``SinkRetry`` and, past that,
    stop without committing (a restart replays from the last durable point)."""


class SinkWriteFailed(SinkError):
    """The destination refused or did not acknowledge results; names the sink and the first reason."""


class ResultTooLarge(SinkError):
    """A result whose record is over Kafka's size limit: it can never be produced, so no retry helps.
    The Kafka sink counts it, logs this and goes on (Redis and S3 hold the result), as the runner's
    dead letters do with a record the DLQ refuses; it never fails a write or a flush."""

    def __init__(self, *, topic: str, request_id: str, shopper_id: str, size: int, limit: int | None) -> None:
        """``size``: the record's value in bytes; ``limit``: the producer's ``message.max.bytes``, or None
        when the broker refused the record (its or the topic's limit, which the producer does not know)."""
        self.topic = topic
        self.request_id = request_id
        self.shopper_id = shopper_id
        self.size = size
        self.limit = limit
        over = (
            f"the producer's message.max.bytes ({limit:,})"
            if limit is not None
            else "the limit of the broker (message.max.bytes) or topic (max.message.bytes)"
        )
        super().__init__(
            f"kafka sink: result {request_id!r} of shopper {shopper_id!r} is {size:,} bytes, over {over}; "
            f"not written to topic {topic!r}"
        )


class S3Unreachable(SinkError):
    """No S3 answered at the configured endpoint when a command or a sink first contacted it (refused,
    no such host, no connection within the timeout): a wrong endpoint, or an S3 that is not up. Names the
    setting the endpoint came from and the endpoint (its user info left out), so that it is one line to act
    on rather than botocore's traceback. Raised at a start only; a store that goes away later is an outage
    the sinks' retry policy waits out (``pipeline.sink_retry``), and its errors stay botocore's."""

    def __init__(self, setting: str, endpoint: str | None, cause: BaseException) -> None:
        reason = " ".join(str(cause).split()) or type(cause).__name__
        super().__init__(
            f"{setting}: no S3 answers at {shown_endpoint(endpoint)} ({reason[:300]}); check the endpoint, "
            "or that S3 is up there"
        )
        self.setting = setting
        self.endpoint = endpoint
