"""Each stack has state of its own, on a Redis it shares with whatever ran before.

``shopper stack up`` reuses a Redis that answers (127.0.0.1:6379, or ``STACK_REDIS_URL``). The runner
keeps sessions and seen events there, so a stack that took the last one's namespace read its fresh
topic's events as duplicates of the old stack's and sent no prompt. Here the shared Redis is a
redis-server of the test's own, and the stacks use the session's broker, S3 and simulator replicas
(given as external services, so ``stack_up`` starts nothing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as sync_redis
from typer.testing import CliRunner

from devstack.processes import group_alive
from devstack.stack import StackSettings, StackState, load_state, sink_settings, stack_down, stack_up
from devstack.synthetic import SyntheticStream
from runner.embedded import EmbeddedRunner
from shopper.cli import app
from tests.conftest import Isolated
from tests.fault_kit import OwnRedis
from tests.helpers import expected_prompts, produce_records


@pytest.fixture
def shared_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    own = OwnRedis(tmp_path)
    own.start()
    yield own
    own.stop()


@pytest.fixture
def s3_keys(stack: StackState, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's S3 given as an external one: its keys come from the environment, as for AWS."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", stack.s3_access_key_id or "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", stack.s3_secret_access_key or "")


def _on_shared_redis(stack: StackState, state_dir: Path, redis_url: str) -> StackSettings:
    return StackSettings(
        state_dir=state_dir,
        kafka_bootstrap=stack.kafka_bootstrap,
        redis_url=redis_url,
        s3_endpoint_url=stack.s3_endpoint_url,
        llm_endpoints=stack.llm_endpoints,
    )


@pytest.mark.usefixtures("s3_keys")
def test_a_new_stack_on_a_shared_redis_reads_its_fresh_topic_as_new_events(
    stack: StackState, shared_redis: OwnRedis, tmp_path: Path
) -> None:
    """The README's flow twice on one Redis: stack up, produce, run until drained, stack down. The
    second stack's runner must see no duplicate and send every prompt again."""
    records = SyntheticStream(shoppers=40, seed=5, malformed_rate=0.0).take(600)
    expected = expected_prompts(records)
    runs = []
    prefixes = []
    for name in ("first", "second"):
        state_dir = tmp_path / name
        state = stack_up(_on_shared_redis(stack, state_dir, shared_redis.url))
        prefixes.append(sink_settings(state).redis_key_prefix)
        try:
            fresh = Isolated(stack)  # the new stack's own topic, as a new broker would have
            fresh.create_topics()
            produce_records(stack.kafka_bootstrap, fresh.topic, records)
            sinks = sink_settings(
                state, s3_prefix=fresh.s3_prefix, s3_max_age_s=0.5, insights_topic=fresh.insights_topic
            )
            runs.append(asyncio.run(EmbeddedRunner(fresh.runner(sinks=sinks)).run()).accounting)
        finally:
            stack_down(state_dir)
    first, second = runs
    assert first.duplicates == 0 and second.duplicates == 0
    assert first.prompts == second.prompts == len(expected)
    assert prefixes[0] != prefixes[1], "each stack writes under a namespace of its own"


@pytest.mark.usefixtures("s3_keys")
def test_stack_up_says_which_redis_and_stack_down_deletes_only_its_keys(
    stack: StackState, shared_redis: OwnRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make demo`` on a shared Redis left hundreds of keys with a 7-day TTL and said nothing."""
    for name, value in {
        "STACK_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "STACK_REDIS_URL": shared_redis.url,
        "STACK_S3_ENDPOINT_URL": stack.s3_endpoint_url or "",
        "STACK_LLM_ENDPOINTS": json.dumps(stack.llm_endpoints),
    }.items():
        monkeypatch.setenv(name, value)
    state_dir = tmp_path / "stack"
    cli = CliRunner()
    up = cli.invoke(app, ["stack", "up", "--state-dir", str(state_dir)])
    assert up.exit_code == 0, up.output
    state = load_state(state_dir)
    assert shared_redis.url in up.output and state.redis_key_prefix in up.output
    assert "shared" in up.output

    client = sync_redis.Redis.from_url(shared_redis.url)
    try:
        ours = [f"{state.redis_key_prefix}signals:shopper-{i}" for i in range(3)]
        for key in ours:
            client.set(key, "1")
        client.set("someone-else:signals:shopper-0", "1")
        down = cli.invoke(app, ["stack", "down", "--state-dir", str(state_dir)])
        assert down.exit_code == 0, down.output
        assert f"deleted {len(ours)} keys" in down.output
        assert client.keys("*") == [b"someone-else:signals:shopper-0"]
    finally:
        client.close()


@pytest.mark.usefixtures("s3_keys")
def test_stack_down_stops_its_processes_when_the_shared_redis_is_down(
    stack: StackState, shared_redis: OwnRedis, tmp_path: Path
) -> None:
    """``stack down`` deleted the keys first: a shared Redis that was down raised there, and every
    process (the gateway here) ran on, with the state file left for ``stack up`` to fail on."""
    state_dir = tmp_path / "stack"
    state = stack_up(_on_shared_redis(stack, state_dir, shared_redis.url))
    assert state.processes and state.redis_shared, "the gateway, on a shared Redis"
    shared_redis.kill()
    down = CliRunner().invoke(app, ["stack", "down", "--state-dir", str(state_dir)])
    assert down.exit_code == 0, down.output
    assert "left this stack's keys" in down.output
    assert not (state_dir / "stack.json").exists()
    assert not any(group_alive(p.pid) for p in state.processes)
