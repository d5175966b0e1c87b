"""A runner whose input is prompts (``RunnerSettings.input`` 'prompts', what the Flink job's
``prompts_topic`` feeds), on the real stack: Kafka (Tansu) -> runner -> gateway and simulator replicas
-> Redis, S3 and the insights topic. Records that are not prompts go to the DLQ with a reason; a prompt
sent twice (a session stage replayed after a restart) is joined or answered from the ledger, not paid
again; every record and prompt is accounted for."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis as sync_redis

from devstack.synthetic import SyntheticStream
from runner.embedded import EmbeddedRunner
from shopper.readback import list_s3_records, read_dlq
from sinks.keys import RedisKeys
from tests.conftest import Isolated
from tests.helpers import assert_latest_wins, expected_prompts, produce_records, signal_versions
from tests.runner.test_rebalance_rearm import seed_pending_sessions

pytestmark = pytest.mark.slow


def test_a_prompts_runner_answers_each_prompt_once_and_dead_letters_the_rest(isolated: Isolated) -> None:
    events = SyntheticStream(shoppers=25, seed=31).take(600)
    expected = expected_prompts(events)
    prompts = sorted(expected.values(), key=lambda p: (p.shopper_id, p.session_epoch, p.seq))
    records = [(p.shopper_id.encode(), p.model_dump_json().encode(), False) for p in prompts]
    newest = prompts[-1]  # its shopper's newest prompt: the copy joins it or reads its answer
    records.append((newest.shopper_id.encode(), newest.model_dump_json().encode(), False))
    past_its_bounds = orjson.loads(newest.model_dump_json()) | {"last_event_ts": 1e300}
    not_prompts = [
        (b"s-x", b'{"shopper_id": "s-x"}', True),
        (b"s-y", b"\xff not json", True),
        (b"s-z", orjson.dumps(past_its_bounds), True),  # S3 cannot date it: it lost its whole batch
    ]
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records + not_prompts)

    lines: list[str] = []
    runner = EmbeddedRunner(isolated.runner(input="prompts"), log=lines.append)
    stats = asyncio.run(runner.run())

    acct = stats.accounting
    assert acct.consumed == len(records) + 3 and acct.dead_lettered == 3
    assert acct.accepted == acct.prompts == len(records)
    assert acct.balanced and acct.errors == 0, [line for line in lines if "error" in line][:5]
    counts = runner.enricher.counts
    assert counts.joined + counts.skipped_answered == 1, counts.as_dict()
    _, stored = list_s3_records(isolated.sinks(), isolated.s3_prefix)
    assert_latest_wins(expected, stored, signal_versions(isolated.stack.redis_url, isolated.prefix))
    dlq = read_dlq(isolated.stack.kafka_bootstrap, isolated.dlq_topic)
    assert sorted(d["reason"].split(":")[0] for d in dlq) == ["not a prompt"] * 3
    assert {orjson.loads(d["original"])["shopper_id"] for d in dlq if d["original_encoding"] == "utf-8"} == {
        "s-x",
        newest.shopper_id,
    }
    assert any("last_event_ts" in d["reason"] for d in dlq)


def test_a_prompts_runner_takes_no_session_partitions_and_fires_no_stored_timer(isolated: Isolated) -> None:
    """A runner whose input is prompts holds no sessions (the Flink job's session stage does), yet on
    every assignment it re-armed the timers stored for its partitions: it took their fencing tokens
    from an events runner on the same key prefix (whose next save was then refused, and which stopped)
    and fired those shoppers' browse pauses, a second time, at its drain. Here the store holds pending
    sessions and their owner's tokens, as an events runner leaves them; the prompts runner touches
    neither and makes exactly the prompts it consumed."""
    partition_of = seed_pending_sessions(isolated.stack.redis_url, isolated.prefix)
    keys = RedisKeys(isolated.prefix)
    client = sync_redis.Redis.from_url(isolated.stack.redis_url)
    owners = [client.get(keys.session_owner(p)) for p in range(4)]
    prompts = list(expected_prompts(SyntheticStream(shoppers=5, seed=33).take(80)).values())
    records = [(p.shopper_id.encode(), p.model_dump_json().encode(), False) for p in prompts]
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records)

    runner = EmbeddedRunner(isolated.runner(input="prompts"), log=lambda _: None)
    stats = asyncio.run(runner.run())

    assert stats.accounting.prompts == len(records) and stats.accounting.balanced
    assert [client.get(keys.session_owner(p)) for p in range(4)] == owners
    _, stored = list_s3_records(isolated.sinks(), isolated.s3_prefix)
    assert sorted(r["request_id"] for r in stored) == sorted(p.request_id for p in prompts), (
        f"a stored timer of {len(partition_of)} fired"
    )
    client.close()
