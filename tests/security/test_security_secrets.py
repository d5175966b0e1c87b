"""No secret is ever printed: a secret is planted in every configuration path, then the output of the
real runner (``shopper run --until-drained``), of the Flink job's entry point and of the real-time
service (``shopper realtime serve``) is searched for it; the in-process dump is checked for every path,
Kafka SASL and URLs with passwords included."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import cast

import aiohttp
import orjson
import pytest
import redis as sync_redis
from pydantic import SecretStr

from devstack.served_process import start_realtime_service
from devstack.synthetic import SyntheticStream
from llm_client.config import ClientConfig
from pipeline.kafka_security import KafkaSecurity
from pipeline.redaction import (
    MASK,
    RedactingStream,
    mask_text,
    mask_url,
    redacted_config_dump,
    secrets_in_environment,
)
from realtime.config import RealtimeSettings
from runner.config import RunnerSettings
from sinks.config import SinkSettings
from tests.conftest import Isolated
from tests.helpers import produce_records
from tests.security_kit import make_certificates, tls_redis

PLANT = "PLANTED-s3cr3t-7f1e"
"""A secret distinctive enough that finding it anywhere in the output means it leaked."""


def test_mask_url_keeps_where_and_drops_the_secret() -> None:
    assert mask_url(f"redis://alice:{PLANT}@cache:6379/0") == f"redis://alice:{MASK}@cache:6379/0"
    assert mask_url(f"https://{PLANT}@llm.example/v1") == f"https://{MASK}@llm.example/v1"
    assert mask_url(f"rediss://:{PLANT}@[::1]:6380") == f"rediss://:{MASK}@[::1]:6380"
    assert mask_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert mask_url("not a url @ all") == "not a url @ all"
    assert PLANT not in mask_url(f"http://u:{PLANT}@host:notaport/")  # unparsable port: still masked


def test_a_secret_query_parameter_is_masked_like_a_user_info_password() -> None:
    assert mask_url(f"redis://cache:6379/0?password={PLANT}") == f"redis://cache:6379/0?password={MASK}"
    assert (
        mask_url(f"rediss://cache/0?db=2&Password={PLANT}&ssl_cert_reqs=none")
        == f"rediss://cache/0?db=2&Password={MASK}&ssl_cert_reqs=none"
    )
    assert (
        mask_url(f"https://s3/b/k?X-Amz-Signature={PLANT}&x=1")
        == f"https://s3/b/k?X-Amz-Signature={MASK}&x=1"
    )
    assert mask_url("redis://cache:6379/0?db=2") == "redis://cache:6379/0?db=2"
    text = f'{{"url": "redis://u:{PLANT}@h:1/0", "other": "http://h/?api_key={PLANT}&a=b"}}'
    assert PLANT not in mask_text(text) and "redis://u:" in mask_text(text) and "a=b" in mask_text(text)


def test_output_stream_masks_environment_secrets_whole_lines_at_a_time() -> None:
    environ = {
        "RUNNER_KAFKA_SECURITY__SASL_PASSWORD": PLANT,
        "REALTIME_API_KEYS": json.dumps([PLANT + "-2"]),
        "SINK_REDIS_URL": f"redis://h:1/0?password={PLANT}-3",
        "LLM_ENDPOINTS": json.dumps([f"http://u:{PLANT}-4@h:1"]),
        "LLM_MAX_TOKENS": "4096",
        "RUNNER_TOKEN_LIMIT": "4096",
        "GATEWAY_PORT": "8100",
    }
    secrets = secrets_in_environment(environ)
    assert {PLANT, PLANT + "-2", PLANT + "-3", PLANT + "-4"} <= secrets
    assert "4096" not in secrets and "8100" not in secrets, "numbers are settings, not secrets"
    target = io.StringIO()
    stream = RedactingStream(target, secrets)
    print("sasl", PLANT[:5], end="", file=stream)  # a secret split over writes is still one line
    print(PLANT[5:], f'"{json.dumps(PLANT + "-2")[1:-1]}"', file=stream)
    stream.write(f"partial {PLANT}-3")
    assert PLANT not in target.getvalue()
    stream.flush()
    assert PLANT not in target.getvalue() and target.getvalue().count(MASK) >= 3
    with pytest.raises(TypeError):
        stream.write(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        stream.buffer  # noqa: B018  (click writes to .buffer if it finds one: it must not)


def test_every_config_path_is_redacted_in_process(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    settings = RunnerSettings(
        kafka_security=KafkaSecurity(
            protocol="SASL_SSL",
            ssl_ca_file=certs.ca,
            ssl_cert_file=certs.cert,
            ssl_key_file=certs.key,
            ssl_key_password=SecretStr(PLANT),
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username="app",
            sasl_password=SecretStr(PLANT),
        ),
        llm=ClientConfig(
            endpoints=[f"https://user:{PLANT}@llm-1:8000"],
            security={"api_key": PLANT},
        ),
        sinks=SinkSettings(
            redis_url=f"rediss://writer:{PLANT}@cache:6380/0",
            s3_access_key_id="AKIAEXAMPLE",
            s3_secret_access_key=SecretStr(PLANT),
        ),
    )
    dumped = redacted_config_dump(settings)
    assert PLANT not in dumped
    data = json.loads(dumped)
    assert data["sinks"]["redis_url"] == "rediss://cache:6380/0" and data["sinks"]["redis_password"] == MASK
    assert data["llm"]["endpoints"] == [f"https://user:{MASK}@llm-1:8000"]
    assert (
        data["kafka_security"]["sasl_password"] == MASK and data["kafka_security"]["sasl_username"] == "app"
    )
    # repr() still shows a URL's password (endpoints are plain strings): components print the dump.
    assert PLANT in repr(settings) and PLANT not in repr(settings.sinks) + repr(settings.kafka_security)
    realtime = RealtimeSettings(api_keys=[SecretStr(PLANT)])
    assert PLANT not in redacted_config_dump(realtime) and PLANT not in repr(realtime)
    # The secret is still there for the clients that need it.
    assert settings.sinks.redis_connection_kwargs()["password"] == PLANT


@pytest.mark.slow
def test_runner_output_holds_no_secret(isolated: Isolated) -> None:
    """The real ``shopper run --until-drained`` with a secret as the password in every LLM replica URL
    and as its S3 secret key (the test stack's simulator and moto accept any), over a short stream;
    stdout, stderr and the stored signals searched."""
    produce_records(
        isolated.stack.kafka_bootstrap, isolated.topic, SyntheticStream(shoppers=5, seed=9).take(60)
    )
    settings = isolated.runner()
    env = {
        **os.environ,
        "RUNNER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "RUNNER_TOPIC": settings.topic,
        "RUNNER_DLQ_TOPIC": settings.dlq_topic,
        "RUNNER_COMMIT_INTERVAL_S": "0.3",
        "RUNNER_TIMER_WALL_PER_EVENT_S": "1000",
        # user:password@ in every replica URL (aiohttp sends it as Basic auth; the simulator ignores it)
        "RUNNER_LLM__ENDPOINTS": orjson.dumps(
            [url.replace("://", f"://runner:{PLANT}@", 1) for url in isolated.stack.llm_endpoints]
        ).decode(),
        "RUNNER_SINKS__REDIS_URL": settings.sinks.redis_url,
        "RUNNER_SINKS__REDIS_KEY_PREFIX": isolated.prefix,
        "RUNNER_SINKS__S3_ENDPOINT_URL": settings.sinks.s3_endpoint_url or "",
        "RUNNER_SINKS__S3_BUCKET": settings.sinks.s3_bucket,
        "RUNNER_SINKS__S3_PREFIX": isolated.s3_prefix,
        "RUNNER_SINKS__INSIGHTS_TOPIC": isolated.insights_topic,
        "RUNNER_SINKS__S3_ACCESS_KEY_ID": settings.sinks.s3_access_key_id or "testing",
        "RUNNER_SINKS__S3_SECRET_ACCESS_KEY": PLANT,
    }
    command = [sys.executable, "-m", "shopper", "run", "--no-from-stack", "--until-drained"]
    done = subprocess.run([*command, "--group-id", isolated.group], env=env, capture_output=True, timeout=240)
    output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    assert done.returncode == 0, output[-3000:]
    assert "runner config:" in output and MASK in output, "the config line is printed, masked"
    assert PLANT not in output
    # Nor in what it stored: results name the replica that answered.
    client = sync_redis.Redis.from_url(isolated.stack.redis_url)
    stored: list[bytes] = []
    try:
        for key in client.scan_iter(match=f"{isolated.prefix}*", count=1000):
            kind = client.type(key)
            if kind == b"hash":
                fields = cast(dict[bytes, bytes], client.hgetall(key))
                stored.append(b" ".join(k + b"=" + v for k, v in fields.items()))
            elif kind == b"string":
                stored.append(cast(bytes | None, client.get(key)) or b"")
    finally:
        client.close()
    assert any(b"replica" in value for value in stored), "signals were stored"
    assert all(PLANT.encode() not in value for value in stored)


def test_flink_job_prints_its_settings_without_secrets(tmp_path: Path) -> None:
    """The job's entry point prints its settings first thing; every secret path is planted in the
    config file. (Without the connector jar it then stops; with it, it is stopped once it printed.)"""
    pytest.importorskip("pyflink")
    config = {
        "kafka": {
            "bootstrap_servers": "127.0.0.1:1",
            "security": {
                "protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "job",
                "sasl_password": PLANT,
            },
        },
        "llm": {"endpoints": [f"https://u:{PLANT}@llm:8000"], "security": {"api_key": PLANT}},
        "sinks": {"redis_url": f"redis://:{PLANT}@127.0.0.1:1/0", "s3_secret_access_key": PLANT},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(config))
    process = subprocess.Popen(
        [sys.executable, "-m", "flink_jobs.near_realtime", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    text = output.decode(errors="replace")
    assert "settings: {" in text, text[-2000:]
    assert MASK in text and PLANT not in text


async def test_realtime_service_output_holds_no_secret(tmp_path: Path) -> None:
    """``shopper realtime serve`` against a TLS Redis whose password is the planted secret (so the
    service really uses it), with the secret also as its API key and the LLM API key; a request is
    made with the key, the service is stopped, and all it printed is searched."""
    certs = make_certificates(tmp_path)
    with tls_redis(tmp_path, certs, PLANT, user="svc", user_password=PLANT) as port:
        env = {
            "REALTIME_API_KEYS": json.dumps([PLANT]),
            "SINK_REDIS_URL": f"rediss://svc:{PLANT}@127.0.0.1:{port}/0",
            "SINK_REDIS_CA_FILE": str(certs.ca),
            "SINK_S3_SECRET_ACCESS_KEY": PLANT,
            "LLM_ENDPOINTS": json.dumps(["http://127.0.0.1:9"]),  # no replica: answers are the fallback
            "LLM_SECURITY__API_KEY": PLANT,
        }
        service = await start_realtime_service(["--no-from-stack"], env)
        try:
            # A deadline with room: the service's admission refuses (429) what it cannot answer in
            # the default 300 ms, as a cold service on a loaded machine did once; not this test's point.
            body = {"shopper_id": "s1", "candidates": ["p1"], "deadline_ms": 5000}
            timeout = aiohttp.ClientTimeout(total=10)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                async with http.post(f"{service.url}/v1/match", json=body, headers={"X-API-Key": PLANT}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["signals"]["shopper"] is False  # Redis read, over TLS
                async with http.get(f"{service.url}/health") as r:
                    assert (await r.json())["redis"] == "ok"
        finally:
            output = await service.stop(timeout_s=30)
        assert MASK in output and PLANT not in output, output[-2000:]
