"""Closing the job's async stage closes what it opened: the LLM client's connections, the Redis pool,
the S3 client and the sink committer's task. The stage runs as on a TaskManager: the function's calls on
PyFlink's own ``AsyncFunctionRunner`` (the thread and event loop the async operator owns, which it stops
and closes before it calls the function's ``close()``), against the stack's real Redis, S3 and simulator
replicas; what stays open is read from this process's TCP sockets."""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
from pyflink.fn_execution.datastream.process.async_function.operation import AsyncFunctionRunner
from pyflink.fn_execution.datastream.process.runtime_context import StreamingRuntimeContext
from pyflink.fn_execution.metrics.process.metric_impl import GenericMetricGroup

from flink_jobs.flink_config import NearRealtimeSettings
from flink_jobs.flink_functions import EnrichAndWrite
from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionProcessor
from tests.conftest import Isolated
from tests.helpers import open_connections

pytestmark = [pytest.mark.flink]

CALL_TIMEOUT_S = 60.0


class Outcome:
    """PyFlink's result handler interface: what the async operator gives each call."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def complete(self, value: Any) -> None:
        self.value = value
        self.done.set()

    def complete_exceptionally(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


def runtime_context() -> StreamingRuntimeContext:
    """The context a Python worker gives an operator, with PyFlink's own (unreported) metric group."""
    return StreamingRuntimeContext(
        "write", "write (1/1)", 1, 128, 0, 0, {}, GenericMetricGroup(None, None), None, False
    )


def started_async_runner() -> AsyncFunctionRunner:
    """PyFlink's async operator's runner: its thread and event loop, started."""
    runner = AsyncFunctionRunner()
    runner.daemon = True
    runner.start()
    runner.wait_ready()
    return runner


def test_closing_the_async_stage_closes_its_clients(isolated: Isolated) -> None:
    sinks = isolated.sinks().model_copy(update={"enabled": ("redis", "s3")})
    settings = NearRealtimeSettings(llm=isolated.llm(), sinks=sinks)
    ports = {
        port
        for url in (sinks.redis_url, sinks.s3_endpoint_url or "", *settings.llm.endpoints)
        if (port := urlsplit(url).port) is not None
    }
    processor = SessionProcessor()
    session = processor.new_session("s-close")
    event = {"event_id": "c1", "shopper_id": "s-close", "type": "add_to_cart", "ts": 1_764_000_000.25}
    event["product"] = {"product_id": "p1", "title": "Trail shoe", "price": 90.0}
    (prompt,) = processor.apply(session, parse_event(orjson.dumps(event))).prompts
    before = open_connections(ports)

    function = EnrichAndWrite(settings.to_json())
    function.open(runtime_context())
    runner = started_async_runner()
    outcome = Outcome()
    runner.run_async(function.async_invoke, prompt.model_dump_json(), outcome)
    assert outcome.done.wait(CALL_TIMEOUT_S) and outcome.error is None, outcome.error
    assert orjson.loads(outcome.value[0])["request_id"] == prompt.request_id
    committer = function.write.committer  # held here, so only closing can release its sockets
    assert open_connections(ports) > before

    runner.stop()  # what AsyncOperation.close does first: stop and close the loop
    function.close()

    left = {port: open_connections({port}) for port in ports}
    assert open_connections(ports) == before, f"sockets to Redis, S3 or the replicas are left open: {left}"
    assert committer._task is not None and committer._task.done(), "the committer's task is left pending"
