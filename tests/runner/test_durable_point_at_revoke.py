"""A periodic durable point under way when a revoke comes: its offsets are committed by the hand-over.

librdkafka holds an offset commit made from another thread until the revoke callback returns
(``tests/runner/test_commit_during_revoke.py``), and the callback waits for the durable point under
way. So a durable point that reached its commit after the revoke began held the hand-over for
``COMMIT_UNDER_WAY_WAIT_S`` (2 s), which then committed nothing of its own, and the next owner replayed
everything since the last commit. With every store a few milliseconds away that was a rare timing;
with them tens of milliseconds away a durable point spans a good part of each second, and so did the
share of revokes that met one. Now a durable point that finds a revoke under way leaves its offsets to
the hand-over, which commits them on the consumer thread, where librdkafka takes them.

Made certain here: the session store is reached through a proxy (``TcpProxy``) that is held
(SIGSTOP) while the durable point saves, a second member joins, and the proxy is released once the
revoke has begun. The real broker, group and Redis.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated
from tests.fault_kit import RunnerLog, TcpProxy, stopping, wait_until
from tests.helpers import produce_records
from tests.runner.kit import cart_add, run_showing_logs, view

pytestmark = pytest.mark.slow

SHOPPERS = 8


def test_a_durable_point_under_way_at_a_revoke_is_committed_by_the_handover(
    isolated: Isolated, tmp_path: Path
) -> None:
    redis = urlsplit(isolated.stack.redis_url)
    assert redis.port is not None
    proxy = TcpProxy(tmp_path, redis.port, name="redis-proxy")
    first_log, second_log = RunnerLog(), RunnerLog()
    with stopping(proxy):
        proxy.start()
        proxied = isolated.sinks().model_copy(update={"redis_url": f"redis://127.0.0.1:{proxy.port}/0"})
        first = EmbeddedRunner(isolated.runner(sinks=proxied, until_drained=False), log=first_log)
        second = EmbeddedRunner(isolated.runner(until_drained=False), log=second_log)
        now = time.time() - 600
        shoppers = [f"shopper-{i:02d}" for i in range(SHOPPERS)]

        async def scenario() -> None:
            tasks = [asyncio.create_task(first.run())]
            try:
                bootstrap, topic = isolated.stack.kafka_bootstrap, isolated.topic
                await asyncio.to_thread(
                    produce_records, bootstrap, topic, [cart_add(s, now) for s in shoppers]
                )
                acct = first.stats.accounting
                await wait_until(
                    lambda: acct.insights == SHOPPERS and not first.epochs, "first batch durable"
                )
                # Views of shoppers in memory: applied without the store, so only the save needs it.
                # The store held first: the durable point that takes the views stalls in their save.
                await asyncio.to_thread(proxy.hold)
                views = [(s.encode(), view(s, now + 1), False) for s in shoppers]
                await asyncio.to_thread(produce_records, bootstrap, topic, views)
                await wait_until(lambda: acct.accepted == 2 * SHOPPERS, "the views applied")
                await wait_until(lambda: first.commits.busy, "a durable point under way", timeout_s=10)
                tasks.append(asyncio.create_task(second.run()))
                await wait_until(lambda: first.handover.revoking, "the revoke begun", timeout_s=60)
                await asyncio.to_thread(proxy.release)
                await wait_until(
                    lambda: any("rebalance: partitions handed over" in line for line in first_log),
                    "the hand-over",
                )
            finally:
                await asyncio.to_thread(proxy.release)
                for runner in (first, second):
                    runner.request_stop()
                await asyncio.gather(*tasks)

        run_showing_logs(scenario(), first=first_log, second=second_log)
    handed = [line for line in first_log if "rebalance: partitions handed over" in line]
    assert "commits nothing of its own" not in first_log.render(), first_log.render()
    assert handed and "committed" in handed[0], handed
    # The next owners replay nothing the first member had applied: no event applied twice.
    assert second.stats.accounting.duplicates == 0, second.stats.accounting
