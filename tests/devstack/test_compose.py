"""docker-compose.yml is valid Compose (against the vendored compose-spec schema, no Docker engine or
network needed) and wires the pipeline the way docs/flink.md describes."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, cast

import jsonschema
import pytest
import yaml

from tests.helpers import unscoped_queries

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests/data/compose_spec.json"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate(value: Any) -> Any:
    """What `docker compose` does with ${VAR:-default} when VAR is unset; `$$` is a literal `$`."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return cast(dict[str, Any], _interpolate(raw))


def test_compose_file_matches_the_compose_spec_schema(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft201909Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_dependencies_volumes_and_build_files_exist(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep in service.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            elif not source.startswith(("/", "~", "$")):
                assert source in compose.get("volumes", {}), f"{name} uses undeclared volume {source}"
        build = service.get("build")
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).is_file()


def test_the_pipeline_services_are_all_there(compose: dict[str, Any]) -> None:
    services = compose["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert {
        "kafka",
        "redis",
        "minio",
        "minio-bucket",
        "jobmanager",
        "taskmanager",
        "job-submitter",
        "producer",
        "simulator-0",
    } <= default
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert "controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert services["trtllm"]["profiles"] == ["trtllm"]
    devices = services["trtllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "/config/aggregated.yaml" in services["trtllm"]["command"]
    assert (ROOT / "serving/trtllm/aggregated.yaml").is_file()


def test_the_submitter_runs_the_job_with_a_config_that_loads(compose: dict[str, Any]) -> None:
    command = compose["services"]["job-submitter"]["command"]
    assert command[:2] == ["flink", "run"] and "-py" in command
    script = command[command.index("-py") + 1].removeprefix("/opt/app/")
    config = command[command.index("--config") + 1].removeprefix("/opt/app/")
    assert (ROOT / script).is_file() and (ROOT / config).is_file()
    from flink_jobs.flink_config import NearRealtimeSettings

    settings = NearRealtimeSettings.load(ROOT / config)
    assert settings.kafka.bootstrap_servers == "kafka:9092"
    assert settings.checkpoint.state_backend == "rocksdb"
    # The KafkaSink's transactions must fit under the broker's cap.
    broker_cap = int(compose["services"]["kafka"]["environment"]["KAFKA_TRANSACTION_MAX_TIMEOUT_MS"])
    assert settings.kafka.transaction_timeout_ms <= broker_cap


def test_the_enrichment_service_runs_what_submit_derives_from_the_job_config(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job hands its prompts to a topic by default; the compose file's enrichment service must read
    that topic and store where the job's config says, as ``shopper flink submit`` would run it."""
    from devstack.enrichment_stage import enrichment_settings
    from flink_jobs.flink_config import NearRealtimeSettings
    from runner.config import RunnerSettings

    command = compose["services"]["job-submitter"]["command"]
    config = command[command.index("--config") + 1].removeprefix("/opt/app/")
    assert NearRealtimeSettings.load(ROOT / config).prompts_topic, "the compose job runs the default"
    for name, value in compose["x-flink-env"].items():  # what the job reads besides its config file
        monkeypatch.setenv(name, value)
    derived = enrichment_settings(NearRealtimeSettings.load(ROOT / config))
    service = compose["services"]["enrichment"]
    for name, value in service["environment"].items():
        monkeypatch.setenv(name, value)
    deployed = RunnerSettings()
    fields = ("bootstrap_servers", "input", "topic", "group_id", "dlq_topic")
    assert {f: getattr(deployed, f) for f in fields} == {f: getattr(derived, f) for f in fields}
    sink_fields = ("enabled", "insights_topic", "redis_url", "s3_endpoint_url", "s3_bucket", "s3_prefix")
    assert deployed.sinks.model_dump(include=set(sink_fields)) == derived.sinks.model_dump(
        include=set(sink_fields)
    )
    assert (deployed.llm.endpoints, deployed.llm.model) == (derived.llm.endpoints, derived.llm.model)
    topics = compose["services"]["kafka-topics"]["command"][0]
    assert f"{derived.topic}:8" in topics and "shopper-events:8" in topics, "prompts: the events' partitions"
    port = service["environment"]["RUNNER_METRICS_PORT"]
    assert f"{port}:{port}" in service["ports"]
    scrape = yaml.safe_load((ROOT / "docker/prometheus.yml").read_text())["scrape_configs"]
    (job,) = [c["job_name"] for c in scrape if c["static_configs"][0]["targets"] == [f"enrichment:{port}"]]
    # The Flink dashboard's enrichment panels read that scrape job alone (the embedded runner's has the
    # same names); that it asks only for names the runner exports: tests/engines/test_engine_agreement.py.
    dashboard = ROOT / "docker/grafana/dashboards/shopper-flink.json"
    assert unscoped_queries(dashboard, re.compile(r"\bshopper_[A-Za-z0-9_]+\b"), job) == []


def test_the_producer_uses_the_shopper_cli(compose: dict[str, Any]) -> None:
    command = compose["services"]["producer"]["command"]
    assert command[:4] == ["shopper", "produce", "--bootstrap", "kafka:9092"]


def test_the_flink_image_bakes_in_the_connector_jar() -> None:
    dockerfile = (ROOT / "docker/flink.Dockerfile").read_text()
    assert "scripts/fetch-flink-connectors" in dockerfile and "/opt/flink/lib" in dockerfile
    assert "apache-flink==2.3.0" in dockerfile


def test_the_flink_services_keep_the_images_pemja_setting(compose: dict[str, Any]) -> None:
    """The compose services' FLINK_PROPERTIES replaces the image's, which loads pemja parent-first
    (thread mode: a second job on a TaskManager fails without it); the devstack and the Kubernetes
    manifest set it too."""
    line = "classloader.parent-first-patterns.additional: pemja."
    assert line in (ROOT / "docker/flink.Dockerfile").read_text()
    flink = [s for s in compose["services"].values() if "FLINK_PROPERTIES" in (s.get("environment") or {})]
    assert flink and all(line in s["environment"]["FLINK_PROPERTIES"] for s in flink)


@pytest.mark.parametrize("dockerfile", ["docker/app.Dockerfile", "docker/flink.Dockerfile"])
def test_the_images_copy_every_package(dockerfile: str) -> None:
    """An image that misses a package fails only at run time, inside a container: check it here."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    text = (ROOT / dockerfile).read_text()
    assert [p for p in packages if f"COPY {p} ./{p}" not in text] == []


def test_the_schema_rejects_a_broken_file(compose: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["redis"]["helthcheck"] = broken["services"]["redis"].pop("healthcheck")
    broken["services"]["kafka"]["ports"] = "9094:9094"
    validator = jsonschema.Draft201909Validator(json.loads(SCHEMA.read_text()))
    assert len(list(validator.iter_errors(broken))) >= 2


def test_the_kubernetes_manifest_runs_this_job_with_these_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/kubernetes/flink-deployment.yaml cannot run here (no Kubernetes): check that what it names
    exists — the PyFlink driver jar of the installed version, the job file, its config — and that its
    variables are settings the job really reads."""
    from flink_jobs.flink_config import NearRealtimeSettings

    manifest = yaml.safe_load((ROOT / "deploy/kubernetes/flink-deployment.yaml").read_text())
    assert manifest["kind"] == "FlinkDeployment"
    job = manifest["spec"]["job"]
    assert job["entryClass"] == "org.apache.flink.client.python.PythonDriver"
    import pyflink

    driver_jar = Path(pyflink.__file__).parent / "opt" / Path(job["jarURI"]).name
    assert driver_jar.is_file(), f"{driver_jar.name} is not the installed PyFlink's driver"
    args = job["args"]
    in_image = {args[i]: args[i + 1] for i in range(0, len(args) - 1, 2)}
    assert (ROOT / in_image["-py"].removeprefix("/opt/app/")).is_file()
    config = in_image["--config"].removeprefix("/opt/app/")
    assert (ROOT / config).is_file() and f"COPY {config} ./{config}" in (
        ROOT / "docker/flink.Dockerfile"
    ).read_text()
    env = manifest["spec"]["podTemplate"]["spec"]["containers"][0]["env"]
    for var in env:
        monkeypatch.setenv(var["name"], var.get("value", "from-a-secret"))
    settings = NearRealtimeSettings()
    plain = {v["name"]: v["value"] for v in env if "value" in v}
    assert settings.kafka.bootstrap_servers == plain["FLINK_JOB_KAFKA__BOOTSTRAP_SERVERS"]
    assert settings.llm.endpoints == json.loads(plain["FLINK_JOB_LLM__ENDPOINTS"])
    assert settings.sinks.redis_password is not None
    assert settings.sinks.redis_password.get_secret_value() == "from-a-secret"


def test_the_kubernetes_enrichment_deployment_answers_the_jobs_prompts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """deploy/kubernetes/enrichment-deployment.yaml beside the FlinkDeployment: it reads the prompts topic
    the job writes, in the group, to the stores and with the LLM fleet the job's settings name."""
    from devstack.enrichment_stage import enrichment_settings
    from flink_jobs.flink_config import NearRealtimeSettings
    from runner.config import RunnerSettings

    flink = yaml.safe_load((ROOT / "deploy/kubernetes/flink-deployment.yaml").read_text())
    args = flink["spec"]["job"]["args"]
    for var in flink["spec"]["podTemplate"]["spec"]["containers"][0]["env"]:
        monkeypatch.setenv(var["name"], var.get("value", "from-a-secret"))
    derived = enrichment_settings(
        NearRealtimeSettings.load(ROOT / args[args.index("--config") + 1].removeprefix("/opt/app/"))
    )
    manifest = yaml.safe_load((ROOT / "deploy/kubernetes/enrichment-deployment.yaml").read_text())
    assert manifest["kind"] == "Deployment"
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    for var in container["env"]:
        monkeypatch.setenv(var["name"], var.get("value", "from-a-secret"))
    deployed = RunnerSettings()
    fields = ("bootstrap_servers", "input", "topic", "group_id", "dlq_topic")
    assert {f: getattr(deployed, f) for f in fields} == {f: getattr(derived, f) for f in fields}
    sink_fields = {"enabled", "insights_topic", "redis_url", "s3_endpoint_url", "s3_bucket", "s3_prefix"}
    assert deployed.sinks.model_dump(include=sink_fields) == derived.sinks.model_dump(include=sink_fields)
    assert deployed.llm.endpoints == derived.llm.endpoints and deployed.llm.policy == derived.llm.policy
    assert deployed.sinks.redis_password is not None
    port = str(deployed.metrics_port)
    assert container["ports"][0]["containerPort"] == int(port)
    assert manifest["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == port


def test_the_minio_healthcheck_uses_a_binary_its_image_ships(compose: dict[str, Any]) -> None:
    """MinIO's images have had no curl since late 2023 (minio/minio#18389), so a curl healthcheck
    never passed and whatever waited for ``service_healthy`` never started; they ship ``mc``."""
    minio = compose["services"]["minio"]
    assert minio["image"].startswith("minio/minio:RELEASE.2025")
    assert minio["healthcheck"]["test"][:3] == ["CMD", "mc", "ready"]
