"""A real standalone Flink cluster on this machine, from the PyFlink wheel's own distribution.

The ``apache-flink`` wheel ships Flink's scripts and jars (``pyflink/bin``, ``lib``, ``opt``,
``plugins``). ``cluster_up`` builds a ``FLINK_HOME`` under the stack's state dir out of links to those
four folders plus a writable ``conf/`` (the wheel's ``config.yaml`` with free ports, small memory and
fast failure detection) and ``log/``, then starts one JobManager and one TaskManager in the foreground
as processes of their own (``jobmanager.sh start-foreground``), so that ``cluster_down`` stops exactly
those processes (and the Python workers in the TaskManager's process group), nothing else.

Jobs go in with the real ``flink run`` (``submit``), configured from the embedded stack's addresses
(``job_settings``); the REST API (``FlinkRest``) watches them, stops them with a savepoint, cancels them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from devstack.errors import FlinkJobFailed, StackError
from devstack.processes import ManagedProcess, free_port, running, spawn, stop, wait_for_http
from devstack.stack import StackState, read_state_file, sink_settings, write_private
from flink_jobs.flink_config import CheckpointSettings, NearRealtimeSettings
from llm_client.config import ClientConfig
from pipeline.kafka_security import configuration_error

JOB_FILE = Path(__file__).resolve().parents[1] / "flink_jobs" / "near_realtime.py"
JOB_ID = re.compile(r"JobID ([0-9a-f]{32})")


class FlinkClusterSettings(BaseModel):
    """Sized for a laptop or a 2-core CI runner: the whole cluster stays near 1.5-2 GB of RSS."""

    jobmanager_memory: str = Field("900m", description="jobmanager.memory.process.size")
    taskmanager_memory: str = Field("1600m", description="taskmanager.memory.process.size")
    taskmanagers: int = Field(
        2, ge=1, description="TaskManager processes: a job at parallelism 2 runs a subtask on each"
    )
    task_slots: int = Field(
        1, ge=1, description="slots per TaskManager: one, so parallel subtasks land on different ones"
    )
    heartbeat_interval_ms: int = Field(2_000, gt=0, description="a lost TaskManager is noticed quickly")
    heartbeat_timeout_ms: int = Field(10_000, gt=0)
    start_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long the JobManager's REST, and then the TaskManagers' slots, may take to come up "
        "('shopper flink up --start-timeout')",
    )


@dataclass
class FlinkClusterState:
    flink_home: str
    rest_port: int
    rpc_port: int
    processes: list[ManagedProcess] = field(default_factory=list)
    metrics_ports: list[int] = field(default_factory=list)
    """Ports Flink's Prometheus reporter may take, one per JobManager or TaskManager process."""

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def metrics_urls(self) -> list[str]:
        """Every port the reporter may serve ``/metrics`` on (the ones no process took refuse)."""
        return [f"http://127.0.0.1:{port}/metrics" for port in self.metrics_ports]

    @property
    def conf_dir(self) -> Path:
        return Path(self.flink_home) / "conf"

    @property
    def log_dir(self) -> Path:
        return Path(self.flink_home) / "log"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, raw: str) -> FlinkClusterState:
        data = json.loads(raw)
        data["processes"] = [ManagedProcess(**p) for p in data.get("processes", [])]
        return cls(**data)


def pyflink_home() -> Path:
    """The Flink distribution inside the installed PyFlink wheel."""
    import pyflink

    return Path(pyflink.__file__).resolve().parent


def cluster_dir(state_dir: Path) -> Path:
    return state_dir / "flink"


def cluster_state_file(state_dir: Path) -> Path:
    return cluster_dir(state_dir) / "cluster.json"


def load_cluster(state_dir: Path) -> FlinkClusterState:
    return read_state_file(
        cluster_state_file(state_dir), FlinkClusterState.from_json, "Flink cluster state", "shopper flink up"
    )


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in the nested YAML tree (Flink 2's config.yaml is standard nested YAML)."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


PROMETHEUS_REPORTER = "org.apache.flink.metrics.prometheus.PrometheusReporterFactory"
"""Flink's own Prometheus reporter, shipped in the wheel's ``plugins/metrics-prometheus``: the job's
``shopper`` metrics (and Flink's) on ``/metrics``, named as ``docs/operations.md`` lists them."""


def make_flink_home(
    root: Path,
    settings: FlinkClusterSettings,
    *,
    rest_port: int,
    rpc_port: int,
    metrics_ports: list[int] | None = None,
) -> Path:
    """``root/home``: links to the wheel's bin/lib/opt/plugins, a writable conf/ and log/. With
    ``metrics_ports``, each process serves Prometheus metrics on the first of them that is free."""
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    dist = pyflink_home()
    for name in ("bin", "opt", "plugins"):
        link = home / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(dist / name, target_is_directory=True)
    _link_lib(home / "lib", dist)
    conf = home / "conf"
    conf.mkdir(exist_ok=True)
    for item in (dist / "conf").iterdir():
        if item.name != "config.yaml":
            (conf / item.name).write_bytes(item.read_bytes())
    tree = yaml.safe_load((dist / "conf" / "config.yaml").read_text()) or {}
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    values: dict[str, Any] = {
        "jobmanager.rpc.address": "localhost",
        "jobmanager.rpc.port": rpc_port,
        "jobmanager.bind-host": "localhost",
        "jobmanager.memory.process.size": settings.jobmanager_memory,
        "taskmanager.bind-host": "localhost",
        "taskmanager.host": "localhost",
        "taskmanager.memory.process.size": settings.taskmanager_memory,
        "taskmanager.numberOfTaskSlots": settings.task_slots,
        "rest.address": "127.0.0.1",
        "rest.bind-address": "127.0.0.1",
        "rest.port": rest_port,
        "heartbeat.interval": settings.heartbeat_interval_ms,
        "heartbeat.timeout": settings.heartbeat_timeout_ms,
        # PEMJA (PyFlink's thread mode) loads libpython once per JVM: from the parent class loader
        # (flink-python in lib/, see _link_lib) every job on this TaskManager can use it.
        "classloader.parent-first-patterns.additional": ["pemja."],
        "io.tmp.dirs": str(tmp),
        "web.tmpdir": str(tmp / "web"),
        "blob.storage.directory": str(tmp / "blobs"),
    }
    if metrics_ports:
        values["metrics.reporter.prom.factory.class"] = PROMETHEUS_REPORTER
        values["metrics.reporter.prom.port"] = ",".join(str(port) for port in metrics_ports)
    for key, value in values.items():
        _set(tree, key, value)
    (conf / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    (home / "log").mkdir(exist_ok=True)
    return home


def _link_lib(lib: Path, dist: Path) -> None:
    """``lib/``: links to the wheel's lib jars plus ``opt/flink-python-*.jar``. With flink-python on the
    TaskManager's own classpath, PEMJA (thread mode) is loaded by the parent class loader once per
    JVM; loaded from a job's class loader, the second job on a TaskManager fails to load libpython
    again (``NoSuchFieldException: loadedLibraryNames`` on Java 17)."""
    if lib.is_symlink():
        lib.unlink()
    lib.mkdir(exist_ok=True)
    for stale in lib.iterdir():
        stale.unlink()
    for jar in [*(dist / "lib").glob("*.jar"), *(dist / "opt").glob("flink-python-*.jar")]:
        (lib / jar.name).symlink_to(jar)


def flink_env(home: Path) -> dict[str, str]:
    """Environment for Flink's scripts: this home, its conf and log, the job's Python on PATH."""
    venv_bin = str(Path(sys.executable).parent)
    return {
        "FLINK_HOME": str(home),
        "FLINK_CONF_DIR": str(home / "conf"),
        "FLINK_LOG_DIR": str(home / "log"),
        "FLINK_LIB_DIR": str(home / "lib"),  # else the scripts take the wheel's lib/ (links resolved)
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
    }


TASKMANAGER_SUPERVISOR = """
child=
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM INT
while :; do
    "$0" start-foreground &
    child=$!
    wait "$child"
    status=$?
    echo "$(date '+%F %T') TaskManager exited with status $status; restarting in $1 s" >&2
    sleep "$1"
done
"""
"""Runs ``taskmanager.sh start-foreground`` and starts it again whenever it exits, as Kubernetes restarts
a TaskManager's pod. The Kafka connector from PyPI (4.0.1) can take a healthy TaskManager down while a
job fails over: closing a sink writer force-closes its producer, the sends still in flight fail, and the
writer rethrows them from its cleanup, which Flink treats as fatal to the process (fixed upstream in
FLINK-38790, in no jar on PyPI). Unsupervised, one lost TaskManager then leaves the cluster without the
slots to restart the job. A SIGTERM stops the TaskManager and the loop; a SIGKILL of the process group
(a lost machine) takes both."""

TASKMANAGER_RESTART_DELAY_S = 2


def start_taskmanager(state: FlinkClusterState, name: str = "flink-taskmanager") -> ManagedProcess:
    """Start one more TaskManager under a restart loop (``TASKMANAGER_SUPERVISOR``); a recovery test
    also calls it to replace one whose process group it killed."""
    home = Path(state.flink_home)
    process = spawn(
        name,
        [
            "bash",
            "-c",
            TASKMANAGER_SUPERVISOR,
            str(home / "bin" / "taskmanager.sh"),
            str(TASKMANAGER_RESTART_DELAY_S),
        ],
        0,
        home / "log",
        env=flink_env(home),
        record=state.processes,
    )
    return process


SPARE_METRICS_PORTS = 3
"""Beyond one per TaskManager: the JobManager, and room for TaskManagers started after one was lost."""


def cluster_up(state_dir: Path, settings: FlinkClusterSettings | None = None) -> FlinkClusterState:
    """Start a JobManager and ``settings.taskmanagers`` TaskManagers; returns once all their slots are
    registered. Reuses a running one. A cluster that does not come up within ``start_timeout_s`` (the
    JobManager's REST, then the slots) is a ``StackError`` that says which part and where the logs are,
    raised after every process this call started is stopped again (no state file is written)."""
    settings = settings or FlinkClusterSettings()
    path = cluster_state_file(state_dir)
    if path.exists():
        existing = load_cluster(state_dir)
        if existing.processes and all(running(p) for p in existing.processes):
            return existing
        cluster_down(state_dir)
    root = cluster_dir(state_dir)
    rest_port, rpc_port = free_port(), free_port()
    metrics_ports = [free_port() for _ in range(settings.taskmanagers + SPARE_METRICS_PORTS)]
    home = make_flink_home(
        root, settings, rest_port=rest_port, rpc_port=rpc_port, metrics_ports=metrics_ports
    )
    state = FlinkClusterState(
        flink_home=str(home), rest_port=rest_port, rpc_port=rpc_port, metrics_ports=metrics_ports
    )
    try:
        jobmanager = spawn(
            "flink-jobmanager",
            [str(home / "bin" / "jobmanager.sh"), "start-foreground"],
            rest_port,
            home / "log",
            env=flink_env(home),
            record=state.processes,
        )
        for n in range(1, settings.taskmanagers + 1):
            start_taskmanager(state, name=f"flink-taskmanager-{n}")
        wait_for_http(jobmanager, "/overview", timeout_s=settings.start_timeout_s)
        slots = settings.taskmanagers * settings.task_slots
        try:
            FlinkRest(state.web_url).wait_for_slots(slots, timeout_s=settings.start_timeout_s)
        except TimeoutError:
            raise StackError(
                f"the Flink cluster did not come up: its {settings.taskmanagers} TaskManager(s) did not "
                f"register {slots} task slot(s) with the JobManager at {state.web_url} within "
                f"{settings.start_timeout_s:g} s; logs in {state.log_dir}"
            ) from None
    except BaseException:
        for process in reversed(state.processes):
            stop(process)
        raise
    write_private(path, state.to_json())  # whole or not at all: `flink down` reads it to find the JVMs
    return state


def save_cluster(state_dir: Path, state: FlinkClusterState) -> None:
    write_private(cluster_state_file(state_dir), state.to_json())


def cluster_down(state_dir: Path) -> list[str]:
    """Stop the processes this cluster's state file lists (TaskManagers first); returns their names."""
    path = cluster_state_file(state_dir)
    if not path.exists():
        return []
    state = load_cluster(state_dir)
    for process in reversed(state.processes):
        stop(process)
    path.unlink()
    return [p.name for p in state.processes]


def cluster_status(state_dir: Path) -> dict[str, object]:
    state = load_cluster(state_dir)
    status: dict[str, object] = {
        "web_ui": state.web_url,
        "prometheus": state.metrics_urls,
        "flink_home": state.flink_home,
        "processes": {f"{p.name} ({p.pid})": ("up" if running(p) else "DOWN") for p in state.processes},
    }
    try:
        rest = FlinkRest(state.web_url)
        status["overview"] = rest.get("/overview")
        status["jobs"] = rest.get("/jobs/overview").get("jobs", [])
    except OSError as exc:
        status["overview"] = f"REST not answering: {exc}"
    return status


# ---- jobs ------------------------------------------------------------------------------------------
def job_settings(stack: StackState, state_dir: Path, **overrides: Any) -> NearRealtimeSettings:
    """The job's settings from the stack's addresses (Kafka, Redis, S3, LLM endpoints); checkpoints
    and savepoints under the stack's state dir. ``overrides`` are ``NearRealtimeSettings`` fields.
    The Kafka address goes in as a dict, so the rest of ``FLINK_JOB_KAFKA__*`` (TLS/SASL included)
    is merged in from the environment rather than replaced by defaults."""
    data: dict[str, Any] = {
        "kafka": {"bootstrap_servers": stack.kafka_bootstrap},
        "checkpoint": CheckpointSettings(
            interval_ms=3_000, directory=(cluster_dir(state_dir).resolve() / "checkpoints").as_uri()
        ),
        "llm": ClientConfig(endpoints=stack.stream_endpoints, model=stack.model),
        "sinks": sink_settings(stack),
        "python_executable": sys.executable,
    }
    try:
        return NearRealtimeSettings(**merged(data, overrides))
    except ValidationError as error:
        raise configuration_error(error, "the Flink job's settings (FLINK_JOB_*, --config)") from None


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` on top, section by section: an override that sets part of a nested
    section (``{"kafka": {"group_id": "g"}}``) keeps the rest of that section's base (the stack's
    address). A shallow update replaced the whole section, and the job ran against the defaults'
    addresses (``kafka:9092``) without a word."""
    out = dict(base)
    for key, value in overrides.items():
        below = out.get(key)
        if isinstance(below, BaseModel):
            below = below.model_dump()
        out[key] = merged(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return out


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    web_url: str
    config: str
    output: str

    @property
    def job_url(self) -> str:
        return f"{self.web_url}/#/job/running/{self.job_id}/overview"


def submit(
    state: FlinkClusterState,
    settings: NearRealtimeSettings,
    *,
    config_path: Path,
    savepoint: str | None = None,
    job_args: tuple[str, ...] = (),
    timeout_s: float = 180.0,
) -> SubmittedJob:
    """``flink run -d`` of the job with ``settings`` written to ``config_path`` (JSON, secrets in
    clear for the workers, so readable by its owner only); returns the job id. ``savepoint`` resumes
    from that savepoint/checkpoint path."""
    config_path.parent.mkdir(parents=True, exist_ok=True)
    write_private(config_path, settings.to_json())
    home = Path(state.flink_home)
    python = settings.python_executable or sys.executable
    argv = [str(home / "bin" / "flink"), "run", "-d"]
    if savepoint:
        argv += ["-s", savepoint]
    argv += ["-pyclientexec", python, "-pyexec", python, "-py", str(JOB_FILE)]
    argv += ["--config", str(config_path), *job_args]
    done = subprocess.run(
        argv,
        env={**os.environ, **flink_env(home)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=str(JOB_FILE.parents[1]),
    )
    output = done.stdout + done.stderr
    match = JOB_ID.search(output)
    if done.returncode != 0 or match is None:
        raise FlinkJobFailed(f"flink run failed (exit {done.returncode}):\n{output[-4000:]}")
    return SubmittedJob(match.group(1), state.web_url, str(config_path), output)


class FlinkRest:
    """The few calls of Flink's REST API that the CLI and tests need (sync; stdlib HTTP)."""

    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            raw = response.read()
        return json.loads(raw) if raw else {}

    def get(self, path: str) -> Any:
        return self._call("GET", path)

    def wait_for_slots(self, slots: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if int(self.get("/overview").get("slots-available", 0)) >= slots:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"no {slots} free task slot(s) at {self.base_url} within {timeout_s} s")

    def job_state(self, job_id: str) -> str:
        return str(self.get(f"/jobs/{job_id}")["state"])

    def wait_for_state(self, job_id: str, states: set[str], timeout_s: float = 180.0) -> str:
        deadline = time.monotonic() + timeout_s
        state = "?"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            if state in {"FAILED", "CANCELED"} and state not in states:
                raise FlinkJobFailed(f"job {job_id} is {state}: {self.get(f'/jobs/{job_id}/exceptions')}")
            time.sleep(0.5)
        why = self.diagnosis(job_id)
        raise TimeoutError(f"job {job_id} still {state} after {timeout_s} s (wanted {sorted(states)}); {why}")

    def wait_running(self, job_id: str, timeout_s: float = 180.0) -> None:
        """Until every task of the job is RUNNING (the job itself is RUNNING before its tasks are)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.get(f"/jobs/{job_id}")
            if job["state"] in {"FAILED", "CANCELED", "FINISHED"}:
                raise FlinkJobFailed(f"job {job_id} is {job['state']}")
            if job["state"] == "RUNNING" and all(v["status"] == "RUNNING" for v in job["vertices"]):
                return
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not running within {timeout_s} s; {self.diagnosis(job_id)}")

    def diagnosis(self, job_id: str) -> str:
        """One line on why a job may be stuck: its state, the cluster's TaskManagers and free slots, the
        other unfinished jobs, and the newest failure's cause (what a CI log must carry, the cluster's
        own logs staying on the CI machine)."""
        try:
            overview = self.get("/overview")
            job = self.get(f"/jobs/{job_id}")
            others = [j["id"][:8] for j in self.unfinished_jobs() if j["id"] != job_id]
            entries = self.get(f"/jobs/{job_id}/exceptions").get("exceptionHistory", {}).get("entries", [])
        except (OSError, KeyError, ValueError) as error:
            return f"no diagnosis: {error!r}"
        newest = "none"
        if entries:
            cause = f"{entries[0].get('exceptionName', '')}: {str(entries[0].get('stacktrace', ''))[:300]}"
            newest = " ".join(cause.split())
        return (
            f"job {job['state']}, {overview.get('taskmanagers')} TaskManager(s), slots "
            f"{overview.get('slots-available')}/{overview.get('slots-total')} free, other unfinished jobs "
            f"{others or 'none'}, {len(entries)} failure(s), newest: {newest}"
        )

    def unfinished_jobs(self) -> list[dict[str, str]]:
        """Every job not yet in a terminal state (``/jobs`` lists ``id`` and ``status``)."""
        terminal = {"FINISHED", "CANCELED", "FAILED"}
        return [j for j in self.get("/jobs")["jobs"] if j["status"] not in terminal]

    def cancel_unfinished(self, timeout_s: float = 60.0) -> list[str]:
        """Cancel every unfinished job and wait until each has ended; returns their ids. A test that
        failed mid-job leaves its job holding slots, and the next test's job would wait for them."""
        cancelled = [j["id"] for j in self.unfinished_jobs()]
        for job_id in cancelled:
            try:
                self.cancel(job_id)
            except OSError:
                continue  # ended between the listing and the cancel
        for job_id in cancelled:
            self.wait_for_state(job_id, {"CANCELED", "FINISHED", "FAILED"}, timeout_s=timeout_s)
        return cancelled

    def completed_checkpoints(self, job_id: str) -> int:
        return int(self.get(f"/jobs/{job_id}/checkpoints")["counts"]["completed"])

    def cancel(self, job_id: str) -> None:
        self._call("PATCH", f"/jobs/{job_id}?mode=cancel")

    def stop_with_savepoint(
        self, job_id: str, directory: str, *, drain: bool = False, timeout_s: float = 180.0
    ) -> str:
        """``flink stop [--drain]``: a savepoint, then the job ends; returns the savepoint's path. With
        ``drain`` the sources first emit the final watermark (every pending trigger fires)."""
        trigger = self._call("POST", f"/jobs/{job_id}/stop", {"targetDirectory": directory, "drain": drain})
        operation = self._wait_operation(job_id, f"savepoints/{trigger['request-id']}", timeout_s)
        return str(operation["location"])

    def trigger_checkpoint(self, job_id: str, *, timeout_s: float = 120.0) -> int:
        """``flink checkpoint``: one checkpoint now, whatever the interval; returns its id once it
        completed (the Kafka source commits its offsets when notified of it)."""
        trigger = self._call("POST", f"/jobs/{job_id}/checkpoints", {"checkpointType": "CONFIGURED"})
        operation = self._wait_operation(job_id, f"checkpoints/{trigger['request-id']}", timeout_s)
        return int(operation["checkpointId"])

    def _wait_operation(self, job_id: str, path: str, timeout_s: float) -> dict[str, Any]:
        """Poll an asynchronous operation (a savepoint, a checkpoint) until it completed; its result, or
        :class:`FlinkJobFailed` when it completed with a failure (a checkpoint declined while tasks of a
        restarted job still deploy)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.get(f"/jobs/{job_id}/{path}")
            if status["status"]["id"] == "COMPLETED":
                operation: dict[str, Any] = status["operation"]
                # A savepoint's result names it "failure-cause", a checkpoint's "failureCause".
                cause = operation.get("failure-cause", operation.get("failureCause"))
                if cause is not None:
                    raise FlinkJobFailed(f"{path.split('/')[0]} of {job_id} failed: {cause}")
                return operation
            time.sleep(0.5)
        raise TimeoutError(f"{path} of {job_id} not done within {timeout_s} s; {self.diagnosis(job_id)}")
