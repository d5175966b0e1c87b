"""The embedded runner end to end with security on: Kafka over mutual TLS (Tansu behind a socat
terminator that requires a client certificate; the client key encrypted) and Redis over TLS as an ACL
user, every certificate from the test's own CA; full accounting after, signals read back over TLS, and
neither password in the runner's log.

Expected to fail until ``runner/embedded.py`` builds its Kafka clients with
``pipeline.kafka_security.librdkafka_properties(settings.kafka_security)`` and its Redis client with
``settings.sinks.redis_client()`` (docs/security.md); ``strict`` turns the wiring landing into a failure
here, so the marker cannot outlive the gap.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis as sync_redis
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from devstack.synthetic import SyntheticStream
from runner.embedded import EmbeddedRunner
from sinks.config import SinkSettings
from tests.conftest import Isolated
from tests.helpers import expected_prompts, final_seq_by_shopper
from tests.security_kit import (
    CLIENT_KEY_PASSWORD,
    kafka_config,
    make_certificates,
    mutual_tls,
    tansu_behind_tls,
    tls_redis,
)

REDIS_PASSWORD = f"runner-pw-{uuid.uuid4().hex[:8]}"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
]


def test_runner_over_mutual_tls_kafka_and_tls_redis(isolated: Isolated, tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    security = mutual_tls(certs)
    with (
        tansu_behind_tls(tmp_path, certs, require_client_cert=True) as bootstrap,
        tls_redis(tmp_path, certs, "unused-default-pw", user="runner", user_password=REDIS_PASSWORD) as port,
    ):
        secure = kafka_config(bootstrap, security)
        admin = AdminClient(secure)
        topics = [NewTopic(isolated.topic, 2, 1), NewTopic(isolated.dlq_topic, 1, 1)]
        for future in admin.create_topics(topics).values():
            future.result(timeout=30)
        records = SyntheticStream(shoppers=10, seed=3, malformed_rate=0.05).take(300)
        producer = Producer({**secure, "linger.ms": 5})
        for key, value, _ in records:
            producer.produce(isolated.topic, key=key, value=value)
        assert producer.flush(30) == 0
        expected = expected_prompts(records)

        sinks = SinkSettings(
            **{
                **isolated.sinks().model_dump(exclude={"redis_url", "redis_username", "redis_password"}),
                "redis_url": f"rediss://runner:{REDIS_PASSWORD}@127.0.0.1:{port}/0",
                "redis_ca_file": certs.ca,
            }
        )
        settings = isolated.runner(bootstrap_servers=bootstrap, kafka_security=security, sinks=sinks)
        lines: list[str] = []

        async def run() -> object:
            async with asyncio.timeout(60):  # unwired, the runner retries the TLS port forever
                return await EmbeddedRunner(settings, log=lines.append).run()

        stats = asyncio.run(run())
        acct = stats.accounting  # type: ignore[attr-defined]
        assert acct.balanced and acct.consumed == len(records)
        assert acct.prompts == len(expected) == acct.insights + acct.superseded

        client = sync_redis.Redis.from_url(sinks.redis_url, **sinks.redis_connection_kwargs())
        try:
            prefix = f"{isolated.prefix}signals:"
            seqs = {
                key.decode()[len(prefix) :]: int(client.hget(key, "seq"))  # type: ignore[arg-type]
                for key in client.scan_iter(match=f"{prefix}*", count=1000)
            }
        finally:
            client.close()
        assert seqs == final_seq_by_shopper(expected)
        log = "\n".join(lines)
        assert REDIS_PASSWORD not in log and CLIENT_KEY_PASSWORD not in log
