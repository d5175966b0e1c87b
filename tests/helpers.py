"""Test helpers: producing records, the offline oracle of what the pipeline must emit (and what must hold
of it under latest wins, the default overload policy), checking a Grafana dashboard against the
metrics a real process serves, running a step with the cyclic collector off, and counting this process's
open TCP connections to some ports."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, cast

import aiohttp
import orjson
import redis as sync_redis
from aiohttp import web
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from devstack.processes import free_port
from prompt_assembly.events import MalformedEvent, parse_event
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.prompt import build_messages
from prompt_assembly.records import PromptRequest
from prompt_assembly.session import ShopperSession

TEMPLATE_TOKENS = re.compile(
    r"<\s*/?\s*(start_of_turn|end_of_turn|bos|eos|s|pad|unk|sys|think|tool_call)\s*>"
    r"|<\||\|>|<\uff5c|\uff5c>|\[\s*/?\s*inst\s*\]|\[\s*(system_prompt|tool_calls|available_tools)\s*\]",
    re.IGNORECASE,
)
"""Chat-template special tokens of the model families we serve or may (Gemma, ChatML/Qwen, Llama 2/3,
Mistral, DeepSeek): text a server tokenizing with special tokens enabled turns into role markers."""


def produce_records(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, bool]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log.connection.close": False})
    for key, value, _ in records:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def expected_prompts(
    records: list[tuple[bytes, bytes, bool]], config: SessionConfig | None = None
) -> dict[str, PromptRequest]:
    """Every prompt the pipeline must emit for ``records`` when pending triggers fire only from event
    time or at the final drain: the same pure processor, run in memory in per-shopper order."""
    processor = SessionProcessor(config)
    sessions: dict[str, ShopperSession] = {}
    prompts: dict[str, PromptRequest] = {}
    for _, value, _ in records:
        try:
            event = parse_event(value)
        except MalformedEvent:
            continue
        session = sessions.setdefault(event.shopper_id, processor.new_session(event.shopper_id))
        for prompt in processor.apply(session, event).prompts:
            prompts[prompt.request_id] = prompt
    for session in sessions.values():
        for prompt in processor.flush(session):
            prompts[prompt.request_id] = prompt
    return prompts


def final_seq_by_shopper(prompts: dict[str, PromptRequest]) -> dict[str, int]:
    seqs: dict[str, int] = {}
    for prompt in prompts.values():
        seqs[prompt.shopper_id] = max(seqs.get(prompt.shopper_id, 0), prompt.seq)
    return seqs


Version = tuple[int, int]
"""A prompt's or a signal's version: ``(session_epoch, seq)``, the order the Redis sink keeps."""


def version_of(result: Mapping[str, Any]) -> Version:
    return (int(result.get("session_epoch", 0)), int(result["seq"]))


def signal_versions(redis_url: str, prefix: str) -> dict[str, Version]:
    """Each shopper's Redis signal version, read from the sink's hash (``{prefix}signals:{shopper}``)."""
    client = sync_redis.Redis.from_url(redis_url)
    head = f"{prefix}signals:"
    try:
        versions: dict[str, Version] = {}
        for key in client.scan_iter(match=f"{head}*", count=1000):
            epoch, seq = cast(list[bytes | None], client.hmget(key, ["session_epoch", "seq"]))
            if isinstance(seq, bytes):
                versions[key.decode()[len(head) :]] = (int(epoch or 0), int(seq))
        return versions
    finally:
        client.close()


def newest_answered(results: Iterable[Mapping[str, Any]]) -> dict[str, Version]:
    """Each shopper's newest version that was answered (an insight): where its signal must stand."""
    versions: dict[str, Version] = {}
    for result in results:
        if result["kind"] == "insight":
            shopper, version = str(result["shopper_id"]), version_of(result)
            versions[shopper] = max(versions.get(shopper, version), version)
    return versions


def assert_latest_wins(
    expected: Mapping[str, PromptRequest],
    results: Iterable[Mapping[str, Any]],
    signals: Mapping[str, Version] | None = None,
) -> dict[str, list[Mapping[str, Any]]]:
    """The oracle of a run under latest wins (the default overload policy, docs/overload.md), where how
    many of a shopper's prompts a newer one supersedes depends on timing, so only this is fixed:

    - every expected prompt has a result (insight, error or superseded) and no other prompt does;
    - a prompt has at most one answer, however often a replay stores it;
    - a prompt superseded by a newer prompt names a newer expected prompt of the same shopper, so a
      shopper's newest prompt is never superseded that way; one dropped as stale (it waited past its
      class's budget, ``OverloadSettings.wait_budget_s``) names none;
    - with ``signals`` (shopper -> version in Redis): each shopper's signal carries the newest version
      that was answered, and a shopper with no answer has none.

    ``results`` may hold copies of a result (a replay); returns them grouped by ``request_id``."""
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for result in results:
        by_id.setdefault(str(result["request_id"]), []).append(result)
    missing, extra = set(expected) - set(by_id), set(by_id) - set(expected)
    assert not missing, f"{len(missing)} prompts have no result: {sorted(missing)[:5]}"
    assert not extra, f"{len(extra)} results the oracle does not expect: {sorted(extra)[:5]}"
    for request_id, copies in by_id.items():
        answers = {orjson.dumps(c["understanding"]) for c in copies if c["kind"] == "insight"}
        assert len(answers) <= 1, f"{request_id} was answered twice, differently"
        prompt = expected[request_id]
        for copy in copies:
            if copy["kind"] != "superseded":
                continue
            if copy["cause"] == "stale":
                assert copy["superseded_by"] is None, copy
                continue
            newer = expected.get(str(copy["superseded_by"]))
            assert newer is not None and newer.shopper_id == prompt.shopper_id, copy
            assert (newer.session_epoch, newer.seq) > (prompt.session_epoch, prompt.seq), copy
    if signals is not None:
        answered = newest_answered(c for copies in by_id.values() for c in copies)
        assert dict(signals) == answered, "each shopper's signal is its newest answered version"
    return by_id


def dashboard_metric_names(dashboard: Path, name: re.Pattern[str]) -> set[str]:
    """The metric names (matching ``name``) a Grafana dashboard's queries ask for: a dashboard is
    checked against what a real process exports, so a renamed metric cannot leave a panel empty."""
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    assert exprs, f"{dashboard.name} has queries"
    return {found for expr in exprs for found in name.findall(expr)}


def unscoped_queries(dashboard: Path, name: re.Pattern[str], job: str) -> list[str]:
    """The queries of a Grafana dashboard that read a metric matching ``name`` without the selector
    ``{job="<job>"}``: two scrape jobs export the same names (the embedded runner and the Flink job's
    enrichment runner), and an unscoped query would add them together."""
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [str(target["expr"]) for panel in panels for target in panel["targets"]]
    scoped = re.compile(name.pattern + re.escape(f'{{job="{job}"}}'))
    return [expr for expr in exprs if len(name.findall(expr)) != len(scoped.findall(expr))]


def _samples(url: str) -> list[Sample]:
    """Every sample a Prometheus endpoint serves."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return _parsed(response.read().decode())


def _parsed(text: str) -> list[Sample]:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _total(samples: Iterable[Sample], name: str, labels: Mapping[str, str]) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def prometheus_names(urls: list[str]) -> set[str]:
    """Every sample name served by those of ``urls`` that answer (Flink's reporter ports that no
    process took refuse)."""
    names: set[str] = set()
    for url in urls:
        try:
            names |= {sample.name for sample in _samples(url)}
        except OSError:
            continue
    return names


def prometheus_total(urls: list[str], name: str, **labels: str) -> float:
    """The sum over ``urls`` of the samples called ``name`` whose labels include ``labels``."""
    return sum(_total(_samples(url), name, labels) for url in urls)


async def served_total(url: str, name: str, **labels: str) -> float:
    """``prometheus_total`` of one endpoint, read without blocking the event loop: for a server that
    runs on the test's own loop (``running_simulator``)."""
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return _total(_parsed(await response.text()), name, labels)


async def until(
    condition: Callable[[], Awaitable[bool]] | Callable[[], bool], within_s: float = 30.0
) -> None:
    """Until ``condition`` (plain or awaitable) holds; ``TimeoutError`` past ``within_s``."""
    async with asyncio.timeout(within_s):
        while True:
            outcome = condition()
            if outcome if isinstance(outcome, bool) else await outcome:
                return
            await asyncio.sleep(0.01)


def viewed_prompt(
    shopper: str, events: int, *, item: str, category: str, hour: int = 10, cents: int = 49
) -> list[dict[str, str]]:
    """A shopper's prompt of ``events`` product views (the real prompt builder), for routing tests:
    each event adds a line, so a longer prompt of the same shopper extends a shorter one's prefix."""
    lines = [
        f"- 2026-11-22 {hour}:{i % 60:02d} viewed: <data>{shopper} {item} {i} with a long title</data> by "
        f"Brand{i % 5}, {category}, ${i}.{cents}\n"
        for i in range(events)
    ]
    return build_messages(shopper, lines)


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` on 127.0.0.1 and a free port until the block exits; yields its base URL (a replica that
    misbehaves on purpose, written by a test in a few lines)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector off for the block (after one collection): what is still alive in it
    was not freed by reference counting, so a reference cycle keeps it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def open_connections(ports: set[int]) -> int:
    """This process's established TCP connections to any of ``ports`` (from /proc: sockets this
    process holds, matched to the kernel's TCP table)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port, state, inode = int(fields[2].split(":")[1], 16), fields[3], fields[9]
            if state == "01" and inode in inodes and remote_port in ports:  # 01: ESTABLISHED
                count += 1
    return count


CLOSE_WAIT_S = 5.0
"""How long closed Kafka clients' broker connections may take to go."""


def broker_connections(bootstrap: str) -> int:
    """This process's established TCP connections to the broker's port."""
    return open_connections({int(bootstrap.rsplit(":", 1)[1])})


def broker_connections_left(bootstrap: str, before: int) -> int:
    """How many more broker connections than ``before`` this process holds, once they are back to
    ``before`` or ``CLOSE_WAIT_S`` has passed."""
    deadline = time.monotonic() + CLOSE_WAIT_S
    while (now := broker_connections(bootstrap)) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    return now - before
