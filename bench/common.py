"""Shared bench helpers: machine description, a throwaway embedded stack, table printing, a paced
open-loop schedule."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from devstack.stack import StackSettings, StackState, stack_down, stack_up
from prompt_assembly.events import parse_event
from prompt_assembly.processor import SessionProcessor
from prompt_assembly.records import PromptRequest
from prompt_assembly.session import ShopperSession

REPO = Path(__file__).resolve().parents[1]
"""The repository root: the working directory and ``PYTHONPATH`` of every process a benchmark starts, so
they import this tree's packages, never a bench module that shares a package's name
(``bench/prompt_assembly.py`` as ``prompt_assembly``)."""

RESULTS_DIR_ENV = "BENCH_RESULTS_DIR"


def results_dir() -> Path:
    """Where a benchmark writes its results JSON and plots: ``bench/results``, the committed results that
    ``docs/`` cites, unless ``BENCH_RESULTS_DIR`` names another folder. The smoke test
    (``tests/bench``) points it at a temporary one, so a short run never overwrites a documented result."""
    override = os.environ.get(RESULTS_DIR_ENV)
    return Path(override) if override else REPO / "bench" / "results"


def write_results(name: str, payload: dict[str, object]) -> Path:
    """Write a benchmark's results as ``name`` under ``results_dir()``, with the machine and the load
    average at the end of the run added, and say where. A table ``docs/`` quotes goes in as ``"table"``,
    as the benchmark printed it, so ``bench.report``'s ``printed_table`` renders it from here."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    record = {"machine": machine(), "load_average_end": list(os.getloadavg()), **payload}
    path.write_text(json.dumps(record, indent=1))
    print(f"results: {path}")
    return path


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f}"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    python = platform.python_version()
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB, Python {python}"


def create_topics(bootstrap: str, names: Iterable[str], partitions: int = 4) -> None:
    """New topics on the broker at ``bootstrap`` (one replica each, as every local broker here has);
    raises if one exists or cannot be made, so that a run never reads a topic an earlier one filled."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, partitions, 1) for name in names]).values():
        future.result(timeout=10)


@contextmanager
def temporary_stack(**settings: object) -> Iterator[StackState]:
    state_dir = Path(tempfile.mkdtemp(prefix="bench-stack-"))
    state = stack_up(StackSettings(state_dir=state_dir, **settings))  # type: ignore[arg-type]
    try:
        yield state
    finally:
        stack_down(state_dir)


def paced(rate: float, seconds: float) -> Iterator[int]:
    """0, 1, 2, ... each at its scheduled time (``n / rate`` s after the start) for ``seconds``: an
    open-loop arrival schedule that does not drift when one send runs late."""
    started = time.time()
    n = 0
    while time.time() - started < seconds:
        time.sleep(max(0.0, started + n / rate - time.time()))
        yield n
        n += 1


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (a fraction: 0.99 for p99) of ``values``, nearest rank."""
    if not 0 <= q <= 1:
        raise ValueError(f"percentile takes a fraction (0.99 for p99), not {q}")
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [
        [f"{v:,.2f}" if isinstance(v, float) else str(v) for v in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    text = "\n".join(lines)
    print(text)
    return text


def machine_busy_seconds() -> float:
    """CPU seconds all cores of this machine spent busy since boot (``/proc/stat``: user, nice, system,
    irq, softirq, steal; Linux only). The difference over a run, divided by its length, is how many
    cores the whole run kept busy: the engine with the broker, Redis, S3 and the replicas it drives."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, every thread (``/proc``; Linux only)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_group_cpu_seconds(pgid: int) -> float:
    """User + system CPU of every live process in process group ``pgid``, with what their exited,
    waited-for children used (``/proc``; Linux only): a Flink TaskManager's JVM and Python workers."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[2]) == pgid:
            total += sum(int(f) for f in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def stream_prompts(records: Sequence[bytes]) -> list[PromptRequest]:
    """Every prompt the session logic makes of ``records`` (events in order, one session per shopper),
    then the pending triggers each session still holds at the end: pure CPU, no engine."""
    processor = SessionProcessor()
    sessions: dict[str, ShopperSession] = {}
    prompts: list[PromptRequest] = []
    for value in records:
        event = parse_event(value)
        session = sessions.get(event.shopper_id)
        if session is None:
            session = sessions[event.shopper_id] = processor.new_session(event.shopper_id)
        prompts.extend(processor.apply(session, event, value).prompts)
    for session in sessions.values():
        prompts.extend(processor.flush(session))
    return prompts
