"""Test helpers: producing records, the offline oracle of what the pipeline must emit, and checking a
Grafana dashboard against the metrics a real process serves."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from devstack.processes import free_port
from prompt_assembly.events import MalformedEvent, parse_event
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.prompt import build_messages
from prompt_assembly.records import PromptRequest
from prompt_assembly.session import ShopperSession


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


def dashboard_metric_names(dashboard: Path, name: re.Pattern[str]) -> set[str]:
    """The metric names (matching ``name``) a Grafana dashboard's queries ask for: a dashboard is
    checked against what a real process exports, so a renamed metric cannot leave a panel empty."""
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    assert exprs, f"{dashboard.name} has queries"
    return {found for expr in exprs for found in name.findall(expr)}


def prometheus_names(urls: list[str]) -> set[str]:
    """Every sample name served by those of ``urls`` that answer (Flink's reporter ports that no
    process took refuse)."""
    names: set[str] = set()
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        except OSError:
            continue
        names |= {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    return names


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
