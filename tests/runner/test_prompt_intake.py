"""A runner whose input is prompts (``RunnerSettings.input`` 'prompts', what the Flink job's
``prompts_topic`` feeds), on the real stack: Kafka (Tansu) -> runner -> gateway and simulator replicas
-> Redis, S3 and the insights topic. Records that are not prompts go to the DLQ with a reason; a prompt
sent twice (a session stage replayed after a restart) is joined or answered from the ledger, not paid
again; every record and prompt is accounted for."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from devstack.synthetic import SyntheticStream
from runner.embedded import EmbeddedRunner
from shopper.readback import list_s3_records, read_dlq
from tests.conftest import Isolated
from tests.helpers import assert_latest_wins, expected_prompts, produce_records, signal_versions

pytestmark = pytest.mark.slow


def test_a_prompts_runner_answers_each_prompt_once_and_dead_letters_the_rest(isolated: Isolated) -> None:
    events = SyntheticStream(shoppers=25, seed=31).take(600)
    expected = expected_prompts(events)
    prompts = sorted(expected.values(), key=lambda p: (p.shopper_id, p.session_epoch, p.seq))
    records = [(p.shopper_id.encode(), p.model_dump_json().encode(), False) for p in prompts]
    newest = prompts[-1]  # its shopper's newest prompt: the copy joins it or reads its answer
    records.append((newest.shopper_id.encode(), newest.model_dump_json().encode(), False))
    not_prompts = [(b"s-x", b'{"shopper_id": "s-x"}', True), (b"s-y", b"\xff not json", True)]
    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, records + not_prompts)

    lines: list[str] = []
    runner = EmbeddedRunner(isolated.runner(input="prompts"), log=lines.append)
    stats = asyncio.run(runner.run())

    acct = stats.accounting
    assert acct.consumed == len(records) + 2 and acct.dead_lettered == 2
    assert acct.accepted == acct.prompts == len(records)
    assert acct.balanced and acct.errors == 0, [line for line in lines if "error" in line][:5]
    counts = runner.enricher.counts
    assert counts.joined + counts.skipped_answered == 1, counts.as_dict()
    _, stored = list_s3_records(isolated.sinks(), isolated.s3_prefix)
    assert_latest_wins(expected, stored, signal_versions(isolated.stack.redis_url, isolated.prefix))
    dlq = read_dlq(isolated.stack.kafka_bootstrap, isolated.dlq_topic)
    assert sorted(d["reason"].split(":")[0] for d in dlq) == ["not a prompt", "not a prompt"]
    assert {orjson.loads(d["original"])["shopper_id"] for d in dlq if d["original_encoding"] == "utf-8"} == {
        "s-x"
    }
