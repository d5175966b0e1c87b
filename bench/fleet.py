"""What the simulated replicas did and do, read from outside as an operator would: their counters
(``/metrics``), an empty prefix cache for each run, and the wait until they are quiet. The benchmarks
that count calls at the replicas (``bench.kill_repay``, ``bench.overload``) share it."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    """A Prometheus endpoint: sample name (with labels) -> value; empty when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return flat_samples(text)


def flat_samples(text: str) -> dict[str, float]:
    """Prometheus text: sample name (with its labels, sorted, as ``name{k=v,...}``) -> value."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


@dataclass
class Replicas:
    """The calls every replica received, and what it runs now, from its ``/metrics``."""

    requests: float = 0.0
    aborted: float = 0.0
    running: float = 0.0
    waiting: float = 0.0

    @classmethod
    def read(cls, endpoints: list[str]) -> Replicas:
        total = cls()
        for endpoint in endpoints:
            m = scrape(f"{endpoint}/metrics")
            total.requests += sum(v for k, v in m.items() if k.startswith("sim_requests_total"))
            total.aborted += m.get("sim_request_errors_total{reason=aborted}", 0.0)
            total.running += m.get("sim_num_requests_running", 0.0)
            total.waiting += m.get("sim_num_requests_waiting", 0.0)
        return total

    def minus(self, before: Replicas) -> Replicas:
        return Replicas(self.requests - before.requests, self.aborted - before.aborted)


def reset_caches(endpoints: list[str]) -> None:
    """Every replica starts each run with an empty prefix cache, so no run is faster for an earlier one."""
    for endpoint in endpoints:
        request = urllib.request.Request(f"{endpoint.rstrip('/')}/admin/reset_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=5):
            pass


def wait_replicas_idle(endpoints: list[str], quiet_s: float = 3.0, timeout_s: float = 300.0) -> None:
    """Until no replica runs or queues a request and none arrived for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = -1.0, time.monotonic()
    while time.monotonic() < deadline:
        now = Replicas.read(endpoints)
        if now.requests != last or now.running or now.waiting:
            last, since = now.requests, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)
    raise TimeoutError(f"replicas still busy {timeout_s} s after the job committed its input")
