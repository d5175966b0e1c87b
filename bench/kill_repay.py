"""Never pay twice: the runner SIGKILLed mid-stream and restarted (or a Flink TaskManager killed), its
LLM calls counted at the replicas against a clean run of the same stream.

    .venv/bin/python -m bench.kill_repay [--events 4000] [--shoppers 150] [--repeats 3]
        [--scenarios backlog,paced,gateway,gateway_paced,flink,flink_prompts,flink_prompts_paced,
                     flink_gateway,flink_gateway_paced]
        [--flink-rate R] [--policies default,fifo]
        [--kill-at 0.4] [--rate R] [--tree OTHER_TREE] [--name kill_repay]

The embedded stack as a new user starts it (``shopper stack up``: Tansu, Redis, moto, three simulated
H100 replicas at the stack's default time scale) and the runner at its defaults (``shopper run``, the
overload policy and the answer ledger as shipped; ``--policies fifo`` adds the arm without latest wins).
Each repeat runs the same stream twice, in processes of their own (``python -m bench.kill_repay
--child``, which is ``EmbeddedRunner(settings).run()`` as ``shopper run --until-drained`` calls it):

- clean: once, until drained;
- killed: the same, SIGKILLed once the replicas have received ``--kill-at`` of the clean run's calls,
  then a new process started at once with the same settings, until drained.

Scenarios: ``backlog``, every event already in the topic; ``paced``, events sent at 1x of the capacity
the clean backlog runs measured (events per second from the first event to the drain; ``--rate`` sets
it), each stamped with the wall clock as it is sent, so the kill lands while the stream still arrives;
``gateway`` and ``gateway_paced``, the same through ``shopper router serve`` (one per run), each call
with its ``request_id`` as ``Idempotency-Key``; ``flink``, the backlog through the Flink job on a local
cluster of one TaskManager, which is SIGKILLed (with its Python workers) and replaced; ``flink_gateway``,
the same through a gateway of each run's own. The gateway arms are the stack's default path (``shopper
stack up`` starts a gateway and the stream jobs call it); ``flink_gateway_paced`` sends the stream at
``--flink-rate`` to the Flink job at its live defaults, through a gateway of each run's own. ``backlog``,
``paced`` and ``flink`` call the
replicas directly, as with ``STACK_GATEWAY=false``. The stack here starts no gateway of its own: each
run gets a fresh one, so that no run is answered from what another run's calls left there.

Counted: calls at the replicas (``sim_requests_total`` of every replica's ``/metrics``; aborted ones
too: ``sim_request_errors_total{reason="aborted"}``), the runner's prompts, insights, superseded and
errors; just before the kill, the dying runner's own ``/metrics`` (LLM calls in flight, admitted,
waiting) and the replicas' running and waiting requests. Re-paid = the killed run's calls - the clean
run's calls, as a share of the clean run's prompts. Each runner process logs every call it starts and
ends by ``request_id`` (``CallLog``), which tells what had become of each call the restarted process
made again: in flight at the kill, answered but not yet in the ledger, in the ledger (a bug), or
cancelled by a newer prompt. Every event and prompt is accounted for from what a reader sees: no valid
event that the clean run has in a stored result (S3, deduplicated on ``request_id``) is missing from the
killed run's, every malformed record has a dead letter, each finished process's accounting balances,
and every answer in the ledger belongs to a stored result (an answer paid for whose prompt never came
back after the restart is an ``orphan``: a prompt re-triggered under another ``request_id``).
Results: ``bench/results/<name>.json``; ``--tree`` runs the runner of another source tree (a worktree
of an older commit) for a before/after.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, create_topics, machine, paced, print_table, results_dir
from bench.fleet import Replicas, reset_caches, scrape
from devstack.processes import free_port
from devstack.stack import StackSettings, StackState, load_state, sink_settings, stack_down, stack_up
from devstack.synthetic import SyntheticStream
from llm_client.config import ClientConfig
from pipeline.enrichment import Enricher, EnrichmentSettings
from pipeline.latest_wins import Claim
from pipeline.overload import OverloadSettings
from prompt_assembly.records import EnrichmentResult, PromptRequest, ShopperInsight
from runner.config import RunnerSettings
from shopper.producer import produce, stamped
from shopper.readback import list_s3_records, read_dlq

MALFORMED_RATE = 0.005
"""``shopper produce``'s default share of broken records."""
SEED = 11
KILL_WAIT_S = 0.5
"""After the SIGKILL, before the replicas' counters are read as the first process's calls: a request
already written to its socket is still read and counted by the replica."""
RUN_TIMEOUT_S = 900.0


# ---- the child: one runner process -------------------------------------------------------------------
@dataclass
class Job:
    """What one runner process runs: the stack (by its state dir) and this run's names."""

    state_dir: str
    topic: str
    dlq: str
    insights: str
    group: str
    prefix: str
    policy: str | None
    metrics_port: int | None
    calls_log: str = ""
    answer_ledger: bool = True
    """``EnrichmentSettings.answer_ledger`` (off: every replay pays again, as before the ledger)."""
    idempotency_key: bool = False
    """Send each prompt's ``request_id`` as ``Idempotency-Key`` (``LLMClient.chat``), where the
    enrichment step does not already (``CallLog``)."""
    """Where the process appends one line per model call it starts and ends (``CallLog``)."""
    endpoints: list[str] | None = None
    """LLM endpoints instead of the stack's replicas (a gateway in front of them)."""


def runner_settings(state: StackState, job: Job) -> RunnerSettings:
    """``shopper run --until-drained`` on the stack: the runner's defaults with this run's names."""
    enrichment = (
        EnrichmentSettings(answer_ledger=job.answer_ledger)
        if job.policy is None
        else EnrichmentSettings(
            answer_ledger=job.answer_ledger,
            overload=OverloadSettings(policy=job.policy),
        )
    )
    return RunnerSettings(
        bootstrap_servers=state.kafka_bootstrap,
        group_id=job.group,
        topic=job.topic,
        dlq_topic=job.dlq,
        until_drained=True,
        metrics_port=job.metrics_port,
        llm=state.replica_client()
        if job.endpoints is None
        else ClientConfig(endpoints=job.endpoints, model=state.model),
        enrichment=enrichment,
        sinks=sink_settings(
            state, redis_key_prefix=job.prefix, s3_prefix=job.prefix.rstrip(":"), insights_topic=job.insights
        ),
    )


class CallLog(Enricher):
    """The runner's enrichment step, unchanged, writing one line per model call to ``path``: ``sent``
    when it starts (past the ledger, latest wins and the gate), then ``insight``, ``error`` or
    ``cancelled`` when it ends, and ``recorded`` once the answer is in the ledger. Each line is one
    ``write`` to a file opened for append, so a SIGKILL leaves every line written before it: which
    ``request_id`` a killed process had sent, had answered, had recorded."""

    path = ""
    idempotency_key = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._pid = os.getpid()
        if self.idempotency_key and "idempotency_key" not in inspect.getsource(Enricher._call):
            chat = self.client.chat

            async def keyed(*args: Any, **kwargs: Any) -> Any:
                return await chat(*args, **kwargs, idempotency_key=self._calling.get())

            self.client.chat = keyed  # type: ignore[method-assign]
        self._calling: contextvars.ContextVar[str | None] = contextvars.ContextVar("calling", default=None)

    def _note(self, what: str, request_id: str) -> None:
        os.write(self._fd, f"{self._pid} {what} {request_id} {time.time():.4f}\n".encode())

    async def _call(self, prompt: PromptRequest, admission_wait_ms: float) -> EnrichmentResult:
        self._note("sent", prompt.request_id)
        self._calling.set(prompt.request_id)  # this task's call: the key of a keyed chat
        try:
            result = await super()._call(prompt, admission_wait_ms)
        except BaseException:
            self._note("cancelled", prompt.request_id)
            raise
        self._note(result.kind, prompt.request_id)
        return result

    async def _answer(
        self, prompt: PromptRequest, claim: Claim | None = None, admission_wait_ms: float = 0.0
    ) -> EnrichmentResult:
        result = await super()._answer(prompt, claim, admission_wait_ms)
        if self.ledger is not None and isinstance(result, ShopperInsight):
            self._note("recorded", prompt.request_id)
        return result


@contextlib.contextmanager
def calls_logged(path: Path, *, idempotency_key: bool = False) -> Iterator[None]:
    """Every runner this process starts inside the block logs its calls to ``path`` (``CallLog``);
    ``idempotency_key``: each call carries its request_id as the key."""
    import runner.embedded as embedded

    CallLog.path, CallLog.idempotency_key = str(path), idempotency_key
    embedded.Enricher = CallLog  # type: ignore[attr-defined]
    try:
        yield
    finally:
        embedded.Enricher = Enricher  # type: ignore[attr-defined]


def child() -> None:
    """Run one runner process until drained; print its totals as one JSON line."""
    import asyncio

    import runner.embedded as embedded

    job = Job(**json.loads(sys.stdin.read()))
    settings = runner_settings(load_state(Path(job.state_dir)), job)
    with calls_logged(Path(job.calls_log), idempotency_key=job.idempotency_key):
        runner = embedded.EmbeddedRunner(settings, log=lambda line: print(line, file=sys.stderr, flush=True))
        stats = asyncio.run(runner.run())
    ended = time.monotonic()
    enricher = runner.enricher
    ledger = enricher.ledger
    totals = {
        "accounting": stats.accounting.as_dict(),
        "balanced": stats.accounting.balanced,
        "overload": enricher.counts.as_dict(),
        "ledger": {} if ledger is None else asdict(ledger.counts),
        "retries": runner.client.retries,
        "seconds": ended - (stats.first_event_at or ended) - settings.drain_idle_s,
        "policy": settings.enrichment.overload.policy,
        "admission_limit": enricher.gate.limit,  # at the end of the run (pipeline.admission_limit)
    }
    print(json.dumps(totals), flush=True)


# ---- the parent --------------------------------------------------------------------------------------
def idempotent_outcomes(gateway_url: str) -> dict[str, float]:
    """The gateway's calls with an ``Idempotency-Key`` by outcome (``joined``, ``reused``, ...)."""
    return {
        k.removeprefix("gateway_idempotent_total{outcome=").rstrip("}"): v
        for k, v in scrape(f"{gateway_url}/metrics").items()
        if k.startswith("gateway_idempotent_total{")
    }


def start_gateway(endpoints: list[str], log: Path) -> tuple[subprocess.Popen[str], str]:
    """``shopper router serve`` in front of ``endpoints``, at its defaults; returns it and its URL."""
    argv = [sys.executable, "-m", "shopper", "router", "serve", "--port", "0"]
    for endpoint in endpoints:
        argv += ["--endpoint", endpoint]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=log.open("a"),
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("READY "):
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
            return process, line.split()[1]
    raise RuntimeError(f"the gateway exited with {process.wait()} before READY; see {log}")


def spawn_child(job: Job, log: Path, tree: Path) -> subprocess.Popen[str]:
    """The runner of the source tree ``tree`` (this one, or another for a before/after)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.kill_repay", "--child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log.open("a"),
        text=True,
        cwd=tree,
        env=env,
        start_new_session=True,  # its own process group: the SIGKILL reaches it and nothing else
    )
    assert process.stdin is not None
    process.stdin.write(json.dumps(asdict(job)))
    process.stdin.close()
    return process


def finish_child(process: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    assert process.stdout is not None
    out = process.stdout.read()
    if process.wait(RUN_TIMEOUT_S) != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"runner exited {process.returncode}; {log}:\n{tail}")
    return dict(json.loads(out.strip().splitlines()[-1]))


@dataclass
class Stream:
    """One stream in one topic: what was produced (the same records for every run of a repeat)."""

    topic: str
    events: int
    valid_ids: set[str]
    malformed: int


def stream_records(events: int, shoppers: int, seed: int) -> tuple[set[str], int]:
    """The valid event ids and the malformed count of ``shopper produce``'s stream (ids do not depend
    on the start time, so a paced stream stamped with the wall clock holds the same ones)."""
    ids: set[str] = set()
    malformed = 0
    for _, value, bad in SyntheticStream(shoppers=shoppers, seed=seed, malformed_rate=MALFORMED_RATE).take(
        events
    ):
        if bad:
            malformed += 1
        else:
            ids.add(json.loads(value)["event_id"])
    return ids, malformed


@dataclass
class Reader:
    """What a reader finds after a run: S3 results, dead letters, ledger entries."""

    results: int = 0
    insights: int = 0
    superseded: int = 0
    errors: int = 0
    replayed: int = 0
    s3_duplicates: int = 0
    uncovered_events: int = 0
    dead_letters: int = 0
    malformed: int = 0
    ledger_answers: int = 0
    ledger_orphans: int = 0
    """Answers recorded in the ledger whose ``request_id`` has no stored result."""
    trimmed_events: int = 0
    """Valid events a stored result names as trimmed before any prompt took them (the session's token
    or event budget cut a hot shopper's log head: ``trimmed_event_ids``)."""
    uncovered: list[str] = field(default_factory=list)
    """Valid events no stored result names, as prompted or as trimmed: events lost."""
    result_ids: list[str] = field(default_factory=list, repr=False)

    @property
    def dead_lettered(self) -> bool:
        return self.dead_letters == self.malformed


def read_back(state: StackState, job: Job, stream: Stream) -> Reader:
    import redis as sync_redis

    sinks = sink_settings(state, redis_key_prefix=job.prefix, s3_prefix=job.prefix.rstrip(":"))
    _, records = list_s3_records(sinks, sinks.s3_prefix)
    by_id: dict[str, dict[str, Any]] = {}
    for record in records:
        by_id.setdefault(str(record["request_id"]), record)
    # Every stored result names its events, a second one of a request_id too: a restored Flink job can
    # make one session version of other events (pipeline.answer_ledger.AnswerLedger.lookup).
    prompted = {str(e) for r in records for e in r.get("new_event_ids") or []}
    trimmed = {str(e) for r in records for e in r.get("trimmed_event_ids") or []}
    covered = prompted | trimmed
    kinds = [str(r.get("kind")) for r in by_id.values()]
    client = sync_redis.Redis.from_url(state.redis_url, decode_responses=True)
    answer = f"{job.prefix}answer:"
    ledger = {k.removeprefix(answer) for k in client.scan_iter(match=f"{answer}*", count=1000)}
    client.close()
    dead = {(d.get("partition"), d.get("offset")) for d in read_dlq(state.kafka_bootstrap, job.dlq)}
    return Reader(
        results=len(by_id),
        insights=kinds.count("insight"),
        superseded=kinds.count("superseded"),
        errors=kinds.count("error"),
        replayed=sum(1 for r in by_id.values() if r.get("replayed")),
        s3_duplicates=len(records) - len(by_id),
        uncovered_events=len(stream.valid_ids - covered),
        trimmed_events=len(stream.valid_ids & trimmed),
        dead_letters=len(dead),
        malformed=stream.malformed,
        ledger_answers=len(ledger),
        ledger_orphans=len(ledger - set(by_id)),
        uncovered=sorted(stream.valid_ids - covered),
        result_ids=sorted(by_id),
    )


@dataclass
class Calls:
    """The model calls of a run by ``request_id``, from the processes' ``CallLog`` lines."""

    sent: int = 0
    """Calls started, all processes."""
    sent_again: int = 0
    """``request_id``s the restarted process sent that the killed one had sent too."""
    again_by_fate: dict[str, int] = field(default_factory=dict)
    """Of those, what had become of the killed process's call: ``in_flight`` (no answer yet),
    ``answered_unrecorded`` (an insight not yet in the ledger), ``recorded`` (in the ledger: it should
    not have been sent again), ``cancelled`` (a newer prompt of the shopper won), ``error``."""
    in_flight_at_kill: int = 0
    """Calls the killed process had started and not ended."""
    only_killed_run: int = 0
    """Distinct prompts sent in this run and never in the clean run of the same stream, by shopper and
    ``seq`` (``_by_shopper_seq``)."""
    ids: set[str] = field(default_factory=set, repr=False)


def _by_shopper_seq(request_ids: set[str]) -> set[tuple[str, str]]:
    """``shopper:epoch:seq`` ids as (shopper, seq): a paced stream stamps its events when they are
    sent, so each run's session epochs (its first events' times) differ, and compared whole every id
    of a paced run was one the clean run never sent."""
    pairs = set()
    for request_id in request_ids:
        shopper, _, seq = request_id.rsplit(":", 2)
        pairs.add((shopper, seq))
    return pairs


def read_calls(path: Path, killed_pid: int | None, clean: set[str] | None) -> Calls:
    """``path``'s calls. With ``killed_pid`` a request_id is sent again when the killed process and the
    restarted one both sent it; without (one process that was never killed, as the runner beside a
    Flink job with a prompts topic), when that process sent it more than once."""
    fate: dict[str, str] = {}
    first: set[str] = set()
    second: set[str] = set()
    sent = 0
    if path.exists():
        for line in path.read_text().splitlines():
            pid, what, request_id, _ = line.split(" ", 3)
            mine = int(pid) == killed_pid
            if what == "sent":
                sent += 1
                if killed_pid is None and request_id in second:
                    first.add(request_id)  # sent before: this call repeats it
                (first if mine else second).add(request_id)
                if mine:
                    fate[request_id] = "in_flight"
            elif mine:
                if what == "insight":
                    fate[request_id] = "answered_unrecorded"
                elif what in {"recorded", "cancelled", "error"}:
                    fate[request_id] = what
    again = first & second
    by_fate: dict[str, int] = {}
    for request_id in again:  # without a killed process no call has a fate: it was just sent twice
        what = fate.get(request_id, "sent_twice")
        by_fate[what] = by_fate.get(what, 0) + 1
    ids = first | second
    return Calls(
        sent=sent,
        sent_again=len(again),
        again_by_fate=by_fate,
        in_flight_at_kill=sum(1 for f in fate.values() if f == "in_flight"),
        only_killed_run=0 if clean is None else len(_by_shopper_seq(ids) - _by_shopper_seq(clean)),
        ids=ids,
    )


@dataclass
class Run:
    scenario: str
    policy: str
    repeat: int
    killed: bool
    calls: float
    aborted: float
    prompts: int
    """Of the last process (the restarted one for a killed run: its replayed prompts included)."""
    totals: list[dict[str, Any]]
    """Each process's own totals (none for the process that was killed)."""
    reader: Reader
    seconds: float
    calls_before_kill: float = 0.0
    at_kill: dict[str, float] = field(default_factory=dict)
    by_id: Calls = field(default_factory=Calls)
    gateway: dict[str, float] = field(default_factory=dict)
    """The gateway's calls with an ``Idempotency-Key`` by outcome (``gateway_idempotent_total``)."""


def one_run(
    state: StackState,
    state_dir: Path,
    logs: Path,
    stream: Stream,
    *,
    scenario: str,
    policy: str | None,
    repeat: int,
    kill_at_calls: float | None,
    clean_ids: set[str] | None = None,
    gateway: bool = False,
    producer: threading.Thread | None = None,
    tree: Path = REPO,
) -> Run:
    """Clean (``kill_at_calls`` None) or killed once the replicas have received that many calls.
    ``gateway``: the runner calls a gateway of this run's own (``shopper router serve``, so no answer
    kept from another run) and sends ``Idempotency-Key``."""
    tag = uuid.uuid4().hex[:8]
    name = f"{scenario}-{policy or 'default'}-{repeat}-{'killed' if kill_at_calls else 'clean'}-{tag}"
    router: subprocess.Popen[str] | None = None
    endpoints = None
    gateway_counts: dict[str, float] = {}
    if gateway:
        router, url = start_gateway(state.llm_endpoints, logs / f"{name}.gateway.log")
        endpoints = [url]
    job = Job(
        state_dir=str(state_dir),
        topic=stream.topic,
        dlq=f"kr-dlq-{tag}",
        insights=f"kr-ins-{tag}",
        group=f"kr-{tag}",
        prefix=f"kr-{tag}:",
        policy=policy,
        metrics_port=free_port(),
        calls_log=str(logs / f"{name}.calls"),
        idempotency_key=gateway,
        endpoints=endpoints,
    )
    create_topics(state.kafka_bootstrap, [job.dlq, job.insights])
    reset_caches(state.llm_endpoints)
    log = logs / f"{name}.log"
    before = Replicas.read(state.llm_endpoints)
    started = time.monotonic()
    if producer is not None:
        producer.start()
    process = spawn_child(job, log, tree)
    at_kill: dict[str, float] = {}
    calls_before_kill = 0.0
    killed_pid: int | None = None
    try:
        if kill_at_calls is not None:
            while Replicas.read(state.llm_endpoints).minus(before).requests < kill_at_calls:
                if process.poll() is not None:
                    raise RuntimeError(f"the runner ended before the kill point; see {log}")
                time.sleep(0.05)
            runner = scrape(f"http://127.0.0.1:{job.metrics_port}/metrics")
            replicas = Replicas.read(state.llm_endpoints)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            killed_pid = process.pid
            at_kill = {
                "seconds": time.monotonic() - started,
                "llm_in_flight": runner.get("shopper_llm_in_flight", float("nan")),
                "admission_active": runner.get("shopper_admission_active", float("nan")),
                "admission_waiting": runner.get("shopper_admission_waiting", float("nan")),
                "prompts_in_flight": runner.get("shopper_prompts_in_flight", float("nan")),
                "prompts_emitted": runner.get("shopper_prompts_emitted_total", float("nan")),
                "insights_written": runner.get("shopper_insights_written_total", float("nan")),
                "replicas_running": replicas.running,
                "replicas_waiting": replicas.waiting,
            }
            time.sleep(KILL_WAIT_S)
            calls_before_kill = Replicas.read(state.llm_endpoints).minus(before).requests
            job.metrics_port = free_port()
            process = spawn_child(job, log, tree)
        totals = [finish_child(process, log)]
    finally:
        if process.poll() is None:  # this run failed or was interrupted: its runner goes with it
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if router is not None:
            assert endpoints is not None
            gateway_counts = idempotent_outcomes(endpoints[0])
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(30)
    if producer is not None:
        producer.join()
    seconds = time.monotonic() - started
    spent = Replicas.read(state.llm_endpoints).minus(before)
    return Run(
        scenario=scenario,
        policy=str(totals[-1]["policy"]),
        repeat=repeat,
        killed=kill_at_calls is not None,
        calls=spent.requests,
        aborted=spent.aborted,
        prompts=int(totals[-1]["accounting"]["prompts"]),
        totals=totals,
        reader=read_back(state, job, stream),
        seconds=seconds,
        calls_before_kill=calls_before_kill,
        at_kill=at_kill,
        by_id=read_calls(Path(job.calls_log), killed_pid, clean_ids),
        gateway=gateway_counts,
    )


def describe_run(run: Run) -> str:
    r = run.reader
    kill = (
        f" killed after {run.calls_before_kill:.0f} calls "
        f"({run.at_kill.get('llm_in_flight', 0):.0f} in flight)"
        if run.killed
        else ""
    )
    return (
        f"  {run.scenario} {run.policy} #{run.repeat} {'killed' if run.killed else 'clean'}:{kill} "
        f"calls {run.calls:.0f} (aborted {run.aborted:.0f}), results {r.results} = insights {r.insights} "
        f"+ superseded {r.superseded} + errors {r.errors}, replayed {r.replayed}, "
        f"uncovered events {r.uncovered_events} (named as trimmed {r.trimmed_events}), "
        f"dead letters {r.dead_letters}/{r.malformed}, "
        f"ledger orphans {r.ledger_orphans}, {run.seconds:.1f} s; by request_id: sent {run.by_id.sent}, "
        f"sent again {run.by_id.sent_again} {run.by_id.again_by_fate}, "
        f"in flight at the kill {run.by_id.in_flight_at_kill}, ids not in the clean run "
        f"{run.by_id.only_killed_run}{f'; gateway {run.gateway}' if run.gateway else ''}"
    )


# ---- the arms ----------------------------------------------------------------------------------------
@dataclass
class Pair:
    clean: Run
    killed: Run

    @property
    def repaid(self) -> float:
        return self.killed.calls - self.clean.calls

    @property
    def share(self) -> float:
        return self.repaid / max(1, self.clean.reader.results)

    @property
    def paid_twice(self) -> float:
        """``request_id``s both processes sent that reached the replicas twice: those a gateway joined to
        the call in flight or answered from its kept answer reached them once."""
        spared = self.killed.gateway.get("joined", 0.0) + self.killed.gateway.get("reused", 0.0)
        return max(0.0, self.killed.by_id.sent_again - spared)

    @property
    def new_ids(self) -> int:
        """Results of the killed run under a ``request_id`` the clean run has no result for (a prompt
        re-triggered under another id after the restart)."""
        return len(set(self.killed.reader.result_ids) - set(self.clean.reader.result_ids))

    @property
    def lost_events(self) -> int:
        """Events the clean run has a result for and the killed run has none."""
        return len(set(self.killed.reader.uncovered) - set(self.clean.reader.uncovered))

    @property
    def accounted(self) -> bool:
        """Every event and prompt of the killed run is where the clean run has it: no event lost, every
        malformed record dead-lettered, every prompt of each finished process with one result, every
        answer in the ledger belonging to a stored result."""
        runs = (self.clean, self.killed)
        return (
            self.lost_events == 0
            and all(r.reader.dead_lettered and r.reader.ledger_orphans == 0 for r in runs)
            and all(bool(t["balanced"]) for r in runs for t in r.totals)
        )


def backlog_stream(state: StackState, events: int, shoppers: int, seed: int) -> Stream:
    topic = f"kr-ev-{uuid.uuid4().hex[:8]}"
    create_topics(state.kafka_bootstrap, [topic])
    produce(
        state.kafka_bootstrap,
        topic,
        events=events,
        shoppers=shoppers,
        rate=None,
        malformed_rate=MALFORMED_RATE,
        seed=seed,
    )
    ids, malformed = stream_records(events, shoppers, seed)
    return Stream(topic, events, ids, malformed)


def produce_live(bootstrap: str, topic: str, events: int, shoppers: int, seed: int, rate: float) -> None:
    """The same records as ``shopper produce``, ``rate`` a second, each event stamped with the wall clock
    as it is sent (``shopper.producer.stamped``, as ``--realtime-ts`` does), paced by ``paced``."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    stream = SyntheticStream(shoppers=shoppers, seed=seed, malformed_rate=MALFORMED_RATE)
    for n, (key, value, bad) in zip(paced(rate, float("inf")), stream.take(events), strict=False):
        now = time.time()
        if not bad:
            value = stamped(value, now)
        producer.produce(topic, key=key, value=value, timestamp=int(now * 1000))
        if n % 100 == 0:
            producer.poll(0)
    producer.flush(30)


def paced_stream(
    state: StackState, events: int, shoppers: int, seed: int, rate: float
) -> tuple[Stream, threading.Thread]:
    """A topic of its own, and the producer thread that fills it at ``rate`` (started by the run)."""
    topic = f"kr-ev-{uuid.uuid4().hex[:8]}"
    create_topics(state.kafka_bootstrap, [topic])
    producer = threading.Thread(
        target=produce_live,
        args=(state.kafka_bootstrap, topic, events, shoppers, seed, rate),
        daemon=True,
    )
    ids, malformed = stream_records(events, shoppers, seed)
    return Stream(topic, events, ids, malformed), producer


def pair(
    state: StackState,
    state_dir: Path,
    logs: Path,
    *,
    scenario: str,
    policy: str | None,
    repeat: int,
    events: int,
    shoppers: int,
    kill_at: float,
    rate: float | None,
    gateway: bool = False,
    tree: Path = REPO,
) -> Pair:
    """The same stream run clean, then killed at ``kill_at`` of the clean run's calls."""
    seed = SEED + repeat
    runs: list[Run] = []
    stream = backlog_stream(state, events, shoppers, seed) if rate is None else None
    for killed in (False, True):
        producer = None
        if rate is not None:
            stream, producer = paced_stream(state, events, shoppers, seed, rate)
        assert stream is not None
        run = one_run(
            state,
            state_dir,
            logs,
            stream,
            scenario=scenario,
            policy=policy,
            repeat=repeat,
            kill_at_calls=max(1.0, kill_at * runs[0].calls) if killed else None,
            clean_ids=runs[0].by_id.ids if killed else None,
            gateway=gateway,
            producer=producer,
            tree=tree,
        )
        print(describe_run(run), flush=True)
        runs.append(run)
    return Pair(runs[0], runs[1])


# ---- the Flink job: a TaskManager killed ---------------------------------------------------------------
def flink_run(
    state: StackState,
    state_dir: Path,
    cluster: Any,
    logs: Path,
    *,
    events: int,
    shoppers: int,
    repeat: int,
    kill_at_calls: float | None,
    gateway: bool = False,
    rate: float | None = None,
    prompts_topic: bool = False,
    clean_ids: set[str] | None = None,
) -> Run:
    """The backlog through the Flink job at its defaults (``bench.flink_kit.bench_job``: prompts from
    event order alone), until the group has committed every record and the replicas are idle. ``rate``:
    instead of a backlog, the events sent at ``rate`` a second once the job runs, each stamped with the
    wall clock as sent, and the job at its live defaults (wall-clock timers, nothing fired at a drain);
    the end is then every record committed and the replicas quiet for longer than a browse pause and a
    rate limit together, so the last shoppers' pending triggers have fired. Killed:
    the TaskManager's process group SIGKILLed once the replicas have received ``kill_at_calls`` calls
    and a new one started at once (``bench.flink_recovery.kill_taskmanager``). ``gateway``: the job calls
    a gateway of this run's own (as the stack's job does its stack's; no answer kept from another run).
    ``prompts_topic``: the job ends at its session stage and a runner with input 'prompts' in this
    process enriches (``bench.flink_kit.prompts_stage``), so the kill takes the sessions, not the calls;
    that runner logs its calls (``calls_logged``), and ``clean_ids`` (the clean run's) tells which
    request_ids only the killed run sent."""
    from confluent_kafka import Producer

    from bench.flink_kit import bench_job, drained, prompts_stage, with_live_defaults
    from bench.flink_recovery import kill_taskmanager, watch_restart
    from devstack.flink_cluster import FlinkRest, submit

    tag = uuid.uuid4().hex[:8]
    settings = bench_job(state, state_dir, tag, {}, live=False)
    if rate is not None:
        settings = with_live_defaults(settings)
    router: subprocess.Popen[str] | None = None
    gateway_counts: dict[str, float] = {}
    if gateway:
        router, url = start_gateway(state.llm_endpoints, logs / f"flink-{repeat}-{tag}.gateway.log")
        settings = settings.model_copy(update={"llm": settings.llm.model_copy(update={"endpoints": [url]})})
    topic = settings.kafka.events_topic
    seed = SEED + repeat
    live_producer: threading.Thread | None = None
    if rate is None:
        producer = Producer({"bootstrap.servers": state.kafka_bootstrap, "linger.ms": 5})
        stream_of = SyntheticStream(shoppers=shoppers, seed=seed, malformed_rate=MALFORMED_RATE)
        for key, value, _ in stream_of.take(events):
            producer.produce(topic, key=key, value=value)
        producer.flush(30)
    else:
        live_producer = threading.Thread(
            target=produce_live,
            args=(state.kafka_bootstrap, topic, events, shoppers, seed, rate),
            daemon=True,
        )
    ids, malformed = stream_records(events, shoppers, seed)
    stream = Stream(topic, events, ids, malformed)
    rest = FlinkRest(cluster.web_url)
    reset_caches(state.llm_endpoints)
    before = Replicas.read(state.llm_endpoints)
    started = time.monotonic()
    calls_log = logs / f"flink-{repeat}-{tag}.calls"
    with contextlib.ExitStack() as stages:
        if prompts_topic:
            stages.enter_context(calls_logged(calls_log))
            settings = stages.enter_context(prompts_stage(state, settings, lambda _: None))
        job = submit(cluster, settings, config_path=state_dir / "flink" / f"kill-repay-{tag}.json")
        at_kill: dict[str, float] = {}
        calls_before_kill = 0.0
        try:
            rest.wait_running(job.job_id)
            if live_producer is not None:
                live_producer.start()
            if kill_at_calls is not None:
                while Replicas.read(state.llm_endpoints).minus(before).requests < kill_at_calls:
                    time.sleep(0.05)
                replicas = Replicas.read(state.llm_endpoints)
                killed = kill_taskmanager(cluster, state_dir)
                at_kill = {
                    "seconds": time.monotonic() - started,
                    "replicas_running": replicas.running,
                    "replicas_waiting": replicas.waiting,
                    "llm_in_flight": replicas.running + replicas.waiting,
                }
                time.sleep(KILL_WAIT_S)
                calls_before_kill = Replicas.read(state.llm_endpoints).minus(before).requests
                at_kill["restart_s"] = watch_restart(rest, job.job_id, killed) - killed
            if live_producer is not None:
                live_producer.join()
            drained(state, settings, live=rate is not None)
        finally:
            rest.cancel(job.job_id)
            if router is not None:
                gateway_counts = idempotent_outcomes(settings.llm.endpoints[0])
                os.killpg(router.pid, signal.SIGTERM)
                router.wait(30)
    spent = Replicas.read(state.llm_endpoints).minus(before)
    reader_job = Job(
        state_dir=str(state_dir),
        topic=topic,
        dlq=settings.kafka.dlq_topic,
        insights=settings.insights_topic or "",
        group=settings.kafka.group_id,
        prefix=settings.sinks.redis_key_prefix,
        policy=None,
        metrics_port=None,
    )
    reader = read_back(state, reader_job, stream)
    return Run(
        scenario=("flink_gateway" if gateway else "flink_prompts" if prompts_topic else "flink")
        + ("_paced" if rate is not None else ""),
        policy=settings.enrichment.overload.policy,
        repeat=repeat,
        killed=kill_at_calls is not None,
        calls=spent.requests,
        aborted=spent.aborted,
        prompts=reader.results,
        totals=[],
        reader=reader,
        seconds=time.monotonic() - started,
        calls_before_kill=calls_before_kill,
        at_kill=at_kill,
        by_id=read_calls(calls_log, None, clean_ids) if prompts_topic else Calls(),
        gateway=gateway_counts,
    )


def flink_pairs(
    state: StackState,
    state_dir: Path,
    logs: Path,
    *,
    events: int,
    shoppers: int,
    repeats: int,
    kill_at: float,
    gateway: bool = False,
    rate: float | None = None,
    prompts_topic: bool = False,
) -> list[Pair]:
    from devstack.flink_cluster import FlinkClusterSettings, cluster_down, cluster_up

    # one TaskManager (one slot), so the one killed is the one running the job (parallelism 1)
    cluster = cluster_up(state_dir, FlinkClusterSettings(taskmanagers=1))
    pairs: list[Pair] = []
    try:
        for repeat in range(repeats):
            clean = flink_run(
                state,
                state_dir,
                cluster,
                logs,
                events=events,
                shoppers=shoppers,
                repeat=repeat,
                kill_at_calls=None,
                gateway=gateway,
                rate=rate,
                prompts_topic=prompts_topic,
            )
            print(describe_run(clean), flush=True)
            killed = flink_run(
                state,
                state_dir,
                cluster,
                logs,
                events=events,
                shoppers=shoppers,
                repeat=repeat,
                kill_at_calls=max(1.0, kill_at * clean.calls),
                gateway=gateway,
                rate=rate,
                prompts_topic=prompts_topic,
                clean_ids=clean.by_id.ids,
            )
            print(describe_run(killed), flush=True)
            pairs.append(Pair(clean, killed))
    finally:
        cluster_down(state_dir)
    return pairs


def interval(values: list[float]) -> str:
    """Mean [min, max] of the repeats."""
    if not values:
        return "-"
    return f"{statistics.mean(values):,.1f} [{min(values):,.1f}, {max(values):,.1f}]"


def pct_interval(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(values):.1%} [{min(values):.1%}, {max(values):.1%}]"


def summarise(arm: str, pairs: list[Pair]) -> dict[str, Any]:
    killed = [p.killed for p in pairs]
    clean = [p.clean for p in pairs]

    def again(fate: str) -> str:
        return interval([float(k.by_id.again_by_fate.get(fate, 0)) for k in killed])

    return {
        "arm": arm,
        "repeats": len(pairs),
        "prompts_clean": interval([float(c.reader.results) for c in clean]),
        "calls_clean": interval([c.calls for c in clean]),
        "calls_killed": interval([k.calls for k in killed]),
        "repaid": interval([p.repaid for p in pairs]),
        "repaid_share": pct_interval([p.share for p in pairs]),
        "in_flight_at_kill": interval([k.at_kill.get("llm_in_flight", float("nan")) for k in killed]),
        "answered_from_ledger": interval([float(k.reader.replayed) for k in killed]),
        "accounted": all(p.accounted for p in pairs),
        "sent_again": interval([float(k.by_id.sent_again) for k in killed]),
        "paid_twice": interval([float(p.paid_twice) for p in pairs]),
        "paid_twice_share": pct_interval([p.paid_twice / max(1, p.clean.reader.results) for p in pairs]),
        "other_prompts": interval([float(k.by_id.only_killed_run) for k in killed]),
        "again_in_flight": again("in_flight"),
        "again_answered_unrecorded": again("answered_unrecorded"),
        "again_recorded": again("recorded"),
        "again_cancelled": again("cancelled"),
        "ledger_orphans": sum(k.reader.ledger_orphans for k in killed),
        # a paced stream is stamped as it is sent, so each run's sessions (their epochs) differ
        "new_ids": "-" if "paced" in pairs[0].clean.scenario else sum(p.new_ids for p in pairs),
        "lost_events": sum(p.lost_events for p in pairs),
    }


TABLE = (
    ("arm", "arm"),
    ("repeats", "repeats"),
    ("prompts_clean", "prompts (clean run)"),
    ("calls_clean", "calls, clean"),
    ("calls_killed", "calls, killed + restarted"),
    ("repaid", "re-paid calls"),
    ("repaid_share", "re-paid / prompts"),
    ("in_flight_at_kill", "LLM calls in flight at the kill"),
    ("answered_from_ledger", "answered from the ledger"),
    ("accounted", "every event and prompt accounted"),
)
CAUSES = (
    ("arm", "arm"),
    ("sent_again", "request_ids sent by both processes"),
    ("paid_twice", "of them paid twice at the replicas"),
    ("paid_twice_share", "paid twice / prompts"),
    ("again_in_flight", "of them in flight at the kill"),
    ("again_answered_unrecorded", "answered, not yet in the ledger"),
    ("again_recorded", "in the ledger"),
    ("again_cancelled", "cancelled by a newer prompt before the kill"),
    ("other_prompts", "prompts sent that the clean run never sent (shopper, seq)"),
    ("ledger_orphans", "ledger orphans"),
    ("new_ids", "results under ids the clean run lacks"),
    ("lost_events", "events lost"),
)
"""Where the re-sent calls came from (the embedded runner's call log; the Flink job keeps none)."""


def capacity(pairs: list[Pair], events: int) -> float:
    """Events per second the clean backlog runs drained at (first event to drained), the median."""
    return float(statistics.median(events / p.clean.totals[-1]["seconds"] for p in pairs))


SCENARIOS = (
    "backlog",
    "paced",
    "gateway",
    "gateway_paced",
    "flink",
    "flink_prompts",
    "flink_prompts_paced",
    "flink_gateway",
    "flink_gateway_paced",
)
"""What ``--scenarios`` may name."""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--events", type=int, default=4000)
    parser.add_argument("--shoppers", type=int, default=150, help="shopper produce's stream, as the demo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--scenarios",
        default="backlog,paced",
        help="comma-separated: backlog, paced, gateway (the backlog through shopper router serve), "
        "gateway_paced (the paced stream through it; needs --rate), "
        "flink (the backlog through the Flink job on a local cluster, a TaskManager killed), "
        "flink_prompts (the same with the job's prompts topic, enriched by a runner with input 'prompts'), "
        "flink_prompts_paced (that, the stream sent at --flink-rate to the job at its live defaults), "
        "flink_gateway (the same through a gateway of each run's own), flink_gateway_paced (the "
        "stream sent at --flink-rate to the job at its live defaults, through a gateway of each run's own)",
    )
    parser.add_argument(
        "--policies", default="default", help="comma-separated overload policies; default = as shipped"
    )
    parser.add_argument("--kill-at", type=float, default=0.4, help="share of the clean run's calls")
    parser.add_argument("--rate", type=float, default=0.0, help="paced events/s; 0 = 1x measured capacity")
    parser.add_argument(
        "--flink-rate",
        type=float,
        default=None,
        help="events/s of the flink_*_paced scenarios: the Flink job's 1x (the rate its clean backlog runs "
        "drain at)",
    )
    parser.add_argument("--name", default="kill_repay", help="results file: bench/results/<name>.json")
    parser.add_argument(
        "--tree",
        type=Path,
        default=REPO,
        help="run the runner of another source tree (a git worktree of an older commit): a before/after",
    )
    args = parser.parse_args()
    if args.child:
        child()
        return
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        parser.error(
            f"--scenarios: {'unknown ' + ', '.join(unknown) if unknown else 'none given'}; "
            f"choose from {', '.join(SCENARIOS)}"
        )
    if "gateway_paced" in scenarios and not args.rate:
        parser.error("--scenarios gateway_paced needs --rate (the paced arm's 1x, measured)")
    needs_flink_rate = [s for s in scenarios if s.startswith("flink") and s.endswith("_paced")]
    if needs_flink_rate and args.flink_rate is None:
        parser.error(
            f"--scenarios {', '.join(needs_flink_rate)} needs --flink-rate (the Flink job's 1x, measured)"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below stops the stack
    policies = [None if p == "default" else p for p in args.policies.split(",") if p]
    state_dir = Path(tempfile.mkdtemp(prefix="bench-kill-repay-"))
    logs = state_dir / "runs"
    logs.mkdir()
    stack = StackSettings(state_dir=state_dir, gateway=False)  # each run starts a gateway of its own
    state = stack_up(stack)
    print(
        f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}; {stack.replicas} simulator replicas "
        f"(time scale {stack.time_scale}); logs in {logs}",
        flush=True,
    )
    out: dict[str, Any] = {
        "machine": machine(),
        "replicas": stack.replicas,
        "time_scale": stack.time_scale,
        "events": args.events,
        "shoppers": args.shoppers,
        "kill_at": args.kill_at,
        "arms": [],
        "runs": [],
    }
    rows: list[list[object]] = []
    causes: list[list[object]] = []
    try:
        for policy in policies:
            arms: list[tuple[str, list[Pair]]] = []

            def repeated(
                scenario: str, rate: float | None, gateway: bool = False, policy: str | None = policy
            ) -> list[Pair]:
                """``--repeats`` clean and killed pairs of one runner scenario."""
                return [
                    pair(
                        state,
                        state_dir,
                        logs,
                        scenario=scenario,
                        policy=policy,
                        repeat=repeat,
                        events=args.events,
                        shoppers=args.shoppers,
                        kill_at=args.kill_at,
                        rate=rate,
                        gateway=gateway,
                        tree=args.tree,
                    )
                    for repeat in range(args.repeats)
                ]

            backlog: list[Pair] = []
            if "backlog" in scenarios or ("paced" in scenarios and not args.rate):
                backlog = repeated("backlog", None)
                arms.append((f"backlog {args.events}, {backlog[0].clean.policy}", backlog))
            if "paced" in scenarios:
                rate = args.rate or capacity(backlog, args.events)
                paced = repeated("paced", rate)
                arms.append((f"paced 1x ({rate:.0f} events/s), {paced[0].clean.policy}", paced))
            if "gateway" in scenarios:
                routed = repeated("gateway", None, gateway=True)
                arms.append((f"backlog {args.events} via the gateway, {routed[0].clean.policy}", routed))
            if "gateway_paced" in scenarios:  # --rate given: checked at parse time
                routed = repeated("gateway_paced", args.rate, gateway=True)
                arms.append(
                    (f"paced 1x ({args.rate:.0f} events/s) via the gateway, {routed[0].clean.policy}", routed)
                )
            flink_arms = {  # scenario: (through a gateway, paced at, label)
                "flink": (False, None, f"Flink, backlog {args.events}"),
                "flink_prompts": (False, None, f"Flink with a prompts topic, backlog {args.events}"),
                "flink_prompts_paced": (
                    False,
                    args.flink_rate,
                    f"Flink with a prompts topic, paced 1x ({args.flink_rate or 0:.0f} events/s)",
                ),
                "flink_gateway": (True, None, f"Flink via the gateway, backlog {args.events}"),
                "flink_gateway_paced": (
                    True,
                    args.flink_rate,
                    f"Flink via the gateway, paced 1x ({args.flink_rate or 0:.0f} events/s)",
                ),
            }
            for scenario, (through_gateway, flink_rate, label) in flink_arms.items():
                if scenario not in scenarios:  # a _paced one has its --flink-rate: checked at parse time
                    continue
                flink = flink_pairs(
                    state,
                    state_dir,
                    logs,
                    events=args.events,
                    shoppers=args.shoppers,
                    repeats=args.repeats,
                    kill_at=args.kill_at,
                    gateway=through_gateway,
                    rate=flink_rate,
                    prompts_topic=scenario.startswith("flink_prompts"),
                )
                arms.append((f"{label}, TaskManager killed, {flink[0].clean.policy}", flink))
            for name, pairs in arms:
                if args.tree.resolve() != REPO:
                    name = f"{name} (runner of {args.tree})"
                summary = summarise(name, pairs)
                out["arms"].append(summary)
                rows.append([summary[k] for k, _ in TABLE])
                causes.append([summary[k] for k, _ in CAUSES])
                for p in pairs:
                    for run in (p.clean, p.killed):
                        record = asdict(run)
                        record["reader"].pop("result_ids")
                        record["reader"]["uncovered"] = len(run.reader.uncovered)
                        record["by_id"].pop("ids")
                        record["arm"] = name
                        out["runs"].append(record)
    finally:
        stack_down(state_dir)
    out["table"] = print_table([h for _, h in TABLE], rows)
    out["causes"] = print_table([h for _, h in CAUSES], causes)
    target = results_dir()
    target.mkdir(parents=True, exist_ok=True)
    (target / f"{args.name}.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
