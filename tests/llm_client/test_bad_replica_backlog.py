"""The runner on a backlog, with one replica of two answering badly: a burst puts many prompts in flight
to the bad replica before its quarantine, and their failovers to the healthy one must not become error
records. They drew on the fleet-wide retry budget: 11.9% (``mixed``) and 12.9% (``not_json``) of the
prompts ended as ``RetryBudgetExhausted`` error records here, as the 11-14% first seen; now none does.

(The runner's own fault suite, ``tests/faults``, runs one bad replica of three at a steady rate; this
is the burst case, kept beside the client's retry rule it exercises.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.stack import StackState
from devstack.synthetic import SyntheticStream
from runner.embedded import EmbeddedRunner
from tests.conftest import SIM_TIME_SCALE, Isolated
from tests.fault_kit import OwnReplicas, RunnerLog, stopping
from tests.faults.test_faults import create_topics
from tests.helpers import produce_records

BACKLOG = 2000
"""Events produced before the runner starts: its first poll is a burst of prompts."""


@pytest.fixture
def iso(stack: StackState) -> Iterator[Isolated]:
    names = Isolated(stack)
    yield names
    names.cleanup()


@pytest.mark.parametrize("kind", ["mixed", "not_json"])
def test_one_bad_replica_of_two_under_a_backlog_turns_at_most_one_percent_into_errors(
    kind: str, stack: StackState, iso: Isolated, tmp_path: Path
) -> None:
    replicas = OwnReplicas(tmp_path, count=2, time_scale=SIM_TIME_SCALE, extra={0: ["--bad-answer", kind]})
    with stopping(replicas):
        replicas.start()
        create_topics(stack.kafka_bootstrap, iso)
        produce_records(
            stack.kafka_bootstrap,
            iso.topic,
            SyntheticStream(shoppers=60, seed=82, malformed_rate=0.01).take(BACKLOG),
        )
        log = RunnerLog()
        llm = iso.llm(endpoints=replicas.endpoints, policy="prefix_aware")
        runner = EmbeddedRunner(iso.runner(llm=llm, drain_idle_s=3.0), log=log)
        asyncio.run(runner.run())
    acct = runner.stats.accounting
    errors = [line for line in log if "error record" in line]
    assert acct.balanced, log[-10:]
    assert runner.client.endpoints[0].invalid_answers, "the burst reached the bad replica"
    assert acct.errors <= 0.01 * acct.prompts, errors[:5]
