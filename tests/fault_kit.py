"""What every fault case shares: the test's own parts (a durable Tansu, a redis-server, a moto server
behind a proxy that can go away, simulator replicas), a paced producer, a watcher that no Redis signal
goes back in time, the reader's accounting of what landed, and the figures each case prints.

The accounting is the reader's, not the runner's: a runner that crashed and replayed counts some events
twice, a killed one reports nothing. What a reader sees must match the offline oracle
(``tests.helpers.expected_prompts``): every prompt has a result (insight, error, or superseded under
latest wins, the default overload policy) in S3 once deduplicated on ``request_id``, a superseded prompt
names a newer prompt of its shopper (``tests.helpers.assert_latest_wins``), every malformed record has
a dead letter, and each shopper's Redis signal is at the newest insight S3 holds for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import boto3
import orjson
import redis as sync_redis
from confluent_kafka import Producer

from devstack.processes import (
    ManagedProcess,
    free_port,
    port_open,
    spawn,
    stop,
    wait_for_http,
    wait_for_port,
)
from devstack.stack import MOTO_CREDENTIALS, StackState, tansu_binary
from prompt_assembly.records import PromptRequest
from runner.embedded import EmbeddedRunner
from serving.simulator.launch import simulator_argv
from shopper.readback import list_s3_records, read_dlq
from sinks.config import SinkSettings
from tests.helpers import assert_latest_wins

Record = tuple[bytes, bytes, bool]


# ---- the figures -----------------------------------------------------------------------------------
@dataclass
class FaultFigures:
    fault: str
    events_in: int
    processed: int
    dead_lettered: int
    lost: int
    reader_duplicates: int
    recover_s: float | None
    notes: str = ""

    HEADER = (
        "| fault | events in | processed | dead-lettered | lost | duplicates a reader can see "
        "| time to recover |\n|---|---|---|---|---|---|---|"
    )

    def row(self) -> str:
        recover = "-" if self.recover_s is None else f"{self.recover_s:.1f} s"
        return (
            f"| {self.fault} | {self.events_in} | {self.processed} | {self.dead_lettered} | {self.lost} "
            f"| {self.reader_duplicates}{f' ({self.notes})' if self.notes else ''} | {recover} |"
        )


class FaultTable:
    """Rows of the module's cases, printed together at the end (``pytest -m faults -s``) and written to
    ``$FAULTS_TABLE`` when set."""

    def __init__(self) -> None:
        self.rows: list[FaultFigures] = []

    def add(self, figures: FaultFigures) -> None:
        self.rows.append(figures)
        print(f"\n{FaultFigures.HEADER}\n{figures.row()}", flush=True)

    def render(self) -> str:
        return "\n".join([FaultFigures.HEADER, *(row.row() for row in self.rows)])


# ---- the reader's accounting -----------------------------------------------------------------------
@dataclass
class ReaderView:
    expected: dict[str, PromptRequest]
    malformed_offsets: int
    s3_ids: Counter[str]
    insight_seq: dict[str, int]
    redis_seq: dict[str, int]
    dlq_positions: Counter[tuple[int, int]]
    missing_prompts: set[str] = field(default_factory=set)
    conflicting: set[str] = field(default_factory=set)
    """Request ids stored more than once with different answers (a replay must repeat itself). A
    superseded copy is no answer: whether a replayed prompt meets its shopper's newer one again
    depends on timing."""
    results: list[dict[str, Any]] = field(default_factory=list)
    """Every result record S3 holds, copies included."""

    @property
    def lost(self) -> int:
        missing_letters = max(0, self.malformed_offsets - len(self.dlq_positions))
        wrong_signals = sum(1 for sid, seq in self.insight_seq.items() if self.redis_seq.get(sid) != seq)
        return len(self.missing_prompts) + missing_letters + wrong_signals

    @property
    def duplicates(self) -> int:
        s3 = sum(n - 1 for n in self.s3_ids.values())
        dlq = sum(n - 1 for n in self.dlq_positions.values())
        return s3 + dlq


def redis_signal_seqs(redis_url: str, prefix: str) -> dict[str, int]:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        head = f"{prefix}signals:"
        seqs: dict[str, int] = {}
        for key in client.scan_iter(match=f"{head}*", count=1000):
            value = client.hget(key, "seq")
            if isinstance(value, bytes):
                seqs[key.decode()[len(head) :]] = int(value)
        return seqs
    finally:
        client.close()


def read_back(
    *,
    bootstrap: str,
    dlq_topic: str,
    sinks: SinkSettings,
    redis_prefix: str,
    s3_prefix: str,
    expected: dict[str, PromptRequest],
    malformed: int,
) -> ReaderView:
    _, records = list_s3_records(sinks, s3_prefix)
    s3_ids = Counter(str(r["request_id"]) for r in records)
    contents: dict[str, set[bytes]] = {}
    for record in records:
        if record.get("kind") == "superseded":
            continue
        same = {k: v for k, v in record.items() if k in ("kind", "seq", "understanding", "error_type")}
        contents.setdefault(str(record["request_id"]), set()).add(
            orjson.dumps(same, option=orjson.OPT_SORT_KEYS)
        )
    insight_seq: dict[str, int] = {}
    for record in records:
        if record.get("kind") == "insight":
            sid = str(record["shopper_id"])
            insight_seq[sid] = max(insight_seq.get(sid, 0), int(record["seq"]))
    dlq = read_dlq(bootstrap, dlq_topic)
    positions = Counter((int(d["partition"]), int(d["offset"])) for d in dlq)
    return ReaderView(
        expected=expected,
        malformed_offsets=malformed,
        s3_ids=s3_ids,
        insight_seq=insight_seq,
        redis_seq=redis_signal_seqs(sinks.redis_url, redis_prefix),
        dlq_positions=positions,
        missing_prompts=set(expected) - set(s3_ids),
        conflicting={rid for rid, seen in contents.items() if len(seen) > 1},
        results=records,
    )


def assert_fully_accounted(view: ReaderView) -> None:
    missing = sorted(
        (view.expected[r].shopper_id, view.expected[r].seq, view.expected[r].reason)
        for r in view.missing_prompts
    )
    assert not view.missing_prompts, (
        f"{len(view.missing_prompts)} prompts have no stored result: {missing[:8]}"
    )
    extra = set(view.s3_ids) - set(view.expected)
    assert not view.conflicting, f"replayed results differ from the first: {sorted(view.conflicting)[:5]}"
    assert not extra, f"{len(extra)} results in S3 the oracle does not expect: {sorted(extra)[:5]}"
    assert set(view.s3_ids) == set(view.expected), "S3 holds exactly the expected prompts"
    assert len(view.dlq_positions) == view.malformed_offsets, "every malformed record is dead-lettered"
    assert view.redis_seq == view.insight_seq, "each Redis signal is the newest stored insight"
    assert_latest_wins(view.expected, view.results)
    assert view.lost == 0


class SignalWatcher:
    """Samples every Redis signal's ``seq`` a few times a second and remembers any that went down.
    Sampling errors (Redis itself down) are skipped."""

    def __init__(self, redis_url: str, prefix: str, interval_s: float = 0.2) -> None:
        self.redis_url, self.prefix, self.interval_s = redis_url, prefix, interval_s
        self.highest: dict[str, int] = {}
        self.regressions: list[tuple[str, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="signal-watcher", daemon=True)

    def __enter__(self) -> SignalWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()

    def sample(self) -> None:
        with contextlib.suppress(sync_redis.RedisError, OSError):
            for sid, seq in redis_signal_seqs(self.redis_url, self.prefix).items():
                before = self.highest.get(sid, 0)
                if seq < before:
                    self.regressions.append((sid, before, seq))
                self.highest[sid] = max(before, seq)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


# ---- producing --------------------------------------------------------------------------------------
class PacedProducer:
    """Produces ``records`` at ``rate`` per second on a thread, in order (one producer: per-shopper
    order holds), so the stream is still arriving when a fault strikes."""

    def __init__(self, bootstrap: str, topic: str, records: list[Record], rate: float) -> None:
        self.bootstrap, self.topic, self.records, self.rate = bootstrap, topic, records, rate
        self.sent = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="paced-producer", daemon=True)

    def start(self) -> PacedProducer:
        self._thread.start()
        return self

    def join(self, timeout_s: float = 120.0) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the producer did not finish"
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            producer = Producer(
                {"bootstrap.servers": self.bootstrap, "linger.ms": 5, "log.connection.close": False}
            )
            started = time.monotonic()
            for i, (key, value, _) in enumerate(self.records):
                wait = started + i / self.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)  # not poll(wait): it returns as soon as a delivery report is served
                producer.poll(0)
                producer.produce(self.topic, key=key, value=value)
                self.sent += 1
            assert producer.flush(60) == 0
        except BaseException as exc:
            self.error = exc


# ---- recovery -------------------------------------------------------------------------------------
class RecoveryClock:
    """Time from a part coming back to the in-process runner's first progress of the kind the part
    stopped, sampled every 50 ms: ``"results"`` (a result stored: Redis and the LLM are on that path)
    or ``"commits"`` (an offset commit: it waits for the S3 flush, and needs the broker)."""

    def __init__(self, runner: EmbeddedRunner, progress: Literal["results", "commits"]) -> None:
        self.runner = runner
        self.progress = progress
        self.restored_at: float | None = None
        self.samples: list[tuple[float, int, int]] = []

    def _sample(self) -> None:
        stats = self.runner.stats
        results = stats.accounting.insights + stats.accounting.errors
        self.samples.append((time.monotonic(), stats.commits, results))

    def restored(self) -> None:
        self._sample()
        self.restored_at = self.samples[-1][0]

    async def watch(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(0.05)

    @property
    def seconds(self) -> float | None:
        self._sample()
        if self.restored_at is None:
            return None
        after = [s for s in self.samples if s[0] >= self.restored_at]
        column = 1 if self.progress == "commits" else 2
        for sample in after:
            if sample[column] > after[0][column]:
                return sample[0] - self.restored_at
        return None


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


# ---- the test's own parts ---------------------------------------------------------------------------
class OwnRedis:
    """A redis-server of the test's own with an fsync-always append-only file, so a SIGKILL and a
    restart on the same port and directory lose nothing that was acknowledged."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: ManagedProcess | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed"
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.process = spawn("redis-own", argv, self.port, self.dir)
        wait_for_port(self.process)

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, 9)
        stop(self.process)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


class TcpProxy:
    """A TCP proxy (``socat``) in front of ``target_port``, on a port of its own that stays the same
    across ``kill`` and ``start``. ``kill`` takes the endpoint away; ``hold`` stops its processes
    (SIGSTOP), so what a client sends waits, unread, in the proxy's socket, as it would behind a
    stalled link, and ``release`` lets it all through in order."""

    def __init__(self, workdir: Path, target_port: int, name: str = "proxy") -> None:
        self.dir = workdir / f"{name}-{target_port}"
        self.name = name
        self.target_port = target_port
        self.port = free_port()
        self.process: ManagedProcess | None = None

    def start(self) -> None:
        socat = shutil.which("socat")
        assert socat is not None, "socat is not installed"
        listen = f"TCP-LISTEN:{self.port},bind=127.0.0.1,reuseaddr,fork"
        self.process = spawn(
            self.name, [socat, listen, f"TCP:127.0.0.1:{self.target_port}"], self.port, self.dir
        )
        wait_for_port(self.process)

    def kill(self) -> None:
        """SIGKILL the proxy's whole group: the listener and every forked connection, so open
        keep-alive connections die too, as they do when an endpoint goes away."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        stop(self.process)
        assert not port_open(self.port), f"{self.name} is down"

    def hold(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)  # the listener and every forked connection

    def release(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)

    def unread_bytes(self) -> int:
        """Bytes clients have sent that the proxy has not read yet (the receive queues of its
        accepted connections, from ``/proc/net/tcp``)."""
        unread = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            state, queues = fields[3], fields[4]
            if local_port == self.port and state == "01":  # ESTABLISHED, the proxy's side
                unread += int(queues.split(":")[1], 16)
        return unread

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.release()
            stop(self.process)


class ProxiedMoto:
    """A moto S3 server of the test's own behind a TCP proxy (``socat``): stopping the proxy takes the
    endpoint away (connections refused) while moto keeps the bucket and its objects."""

    def __init__(self, workdir: Path, bucket: str) -> None:
        self.dir = workdir / "moto"
        self.bucket = bucket
        self.moto_port = free_port()
        self.proxy = TcpProxy(workdir, self.moto_port, name="s3-proxy")
        self.url = f"http://127.0.0.1:{self.proxy.port}"
        self.moto: ManagedProcess | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.moto_port)]
        self.moto = spawn("moto-own", argv, self.moto_port, self.dir)
        wait_for_port(self.moto, timeout_s=60)
        self.start_proxy()
        s3 = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.moto_port}",
            region_name="us-east-1",
            aws_access_key_id=MOTO_CREDENTIALS[0],
            aws_secret_access_key=MOTO_CREDENTIALS[1],
        )
        s3.create_bucket(Bucket=self.bucket)

    def start_proxy(self) -> None:
        self.proxy.start()

    def stop_proxy(self) -> None:
        """The S3 endpoint goes away (``TcpProxy.kill``); moto keeps the bucket and its objects."""
        self.proxy.kill()

    def stop(self) -> None:
        self.proxy.stop()
        if self.moto is not None:
            stop(self.moto)


class DurableTansu:
    """A Tansu broker of the test's own, its storage on the stack's S3 endpoint (Tansu's default is memory): a
    SIGKILL and a restart on the same port and bucket keep every topic, record and committed offset."""

    def __init__(self, workdir: Path, stack: StackState, bucket: str) -> None:
        assert stack.s3_endpoint_url is not None
        self.dir = workdir / "tansu"
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.bucket = bucket
        self.env = {
            "AWS_ENDPOINT": stack.s3_endpoint_url,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": stack.s3_access_key_id or MOTO_CREDENTIALS[0],
            "AWS_SECRET_ACCESS_KEY": stack.s3_secret_access_key or MOTO_CREDENTIALS[1],
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        s3 = boto3.client(
            "s3",
            endpoint_url=stack.s3_endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )
        s3.create_bucket(Bucket=bucket)
        self.process: ManagedProcess | None = None

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        argv = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url]
        argv += ["--storage-engine", f"s3://{self.bucket}/"]
        self.process = spawn("tansu-durable", argv, self.port, self.dir, env=self.env)
        wait_for_port(self.process)

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, 9)
        stop(self.process)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


class OwnReplicas:
    """Simulator replicas of the test's own, killed and restarted on the same ports."""

    def __init__(
        self, workdir: Path, count: int, time_scale: float, extra: Mapping[int, Sequence[str]] | None = None
    ) -> None:
        """``extra``: more simulator flags for some replicas, by index (e.g. a bad-answer fault)."""
        self.dir = workdir / "replicas"
        self.ports = [free_port() for _ in range(count)]
        self.time_scale = time_scale
        self.extra = dict(extra or {})
        self.endpoints = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.processes: list[ManagedProcess] = []

    def start(self) -> None:
        self.processes = [
            spawn(
                f"own-sim-{i}",
                simulator_argv(
                    port=port,
                    replica_id=f"own-sim-{i}",
                    time_scale=self.time_scale,
                    extra=self.extra.get(i, ()),
                ),
                port,
                self.dir,
            )
            for i, port in enumerate(self.ports)
        ]

    def bad_answers_sent(self, index: int) -> int:
        """Bad answers replica ``index`` has sent so far (its own ``/metrics``)."""
        with urllib.request.urlopen(f"{self.endpoints[index]}/metrics", timeout=5) as response:
            text = response.read().decode()
        match = re.search(r'^sim_request_errors_total\{reason="bad_answer"\} ([0-9.e+]+)$', text, re.M)
        return 0 if match is None else int(float(match.group(1)))
        for process in self.processes:
            wait_for_http(process)

    def kill(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
        for process in self.processes:
            stop(process)

    def stop(self) -> None:
        for process in self.processes:
            stop(process)


@contextlib.contextmanager
def stopping(*parts: OwnRedis | ProxiedMoto | DurableTansu | OwnReplicas | TcpProxy) -> Iterator[None]:
    try:
        yield
    finally:
        for part in parts:
            part.stop()


class RunnerLog(list[str]):
    """A runner's ``log``: keeps its lines (as written) and when each came, so that a failed case can
    print the runner's own story (``render``) beside the assertion, however rare the failure."""

    def __init__(self) -> None:
        super().__init__()
        self._t0 = time.monotonic()
        self._at: list[float] = []

    def __call__(self, line: str) -> None:
        self._at.append(time.monotonic() - self._t0)
        self.append(line)

    def render(self, last: int | None = None) -> str:
        lines = list(zip(self._at, self, strict=False))
        return "\n".join(f"{at:8.2f} {line}" for at, line in lines[-last if last else 0 :])

    def timeout_report(self) -> str:
        """The last lines, for ``tests.timeout_report`` when the case hangs past its timeout."""
        return self.render(last=8)
