"""A call cut at its deadline, with and without a grace (``llm_client.cut_calls``), against a simulated
replica over real HTTP. What is checked is what the replica and the kernel see: whether the replica
finished the request or aborted it (its ``/metrics``), and which TCP connections the client holds to it
(``/proc/net/tcp``): within the grace the cut call's connection is kept and the next call reuses it;
without one, or past it, the connection is closed and the replica aborts the request."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path

import pytest

from llm_client import ClientConfig, LLMClient, cut_calls
from llm_client.config import HealthSettings, RetrySettings, Timeouts
from llm_client.cut_calls import PROBE_EVERY
from llm_client.errors import BadRequest, DeadlineExceeded
from serving.simulator.testing import running_simulator
from tests.helpers import collector_off, served_total, until

MESSAGES = [
    {"role": "system", "content": "You describe shoppers. " * 40},
    {"role": "user", "content": "viewed hats"},
]
FAST = 0.1
"""Simulator time scale at which a 200-token answer takes about 0.5 s on this machine."""
SLOW = 1.0
"""... and about 5 s."""


def config(url: str, grace_s: float, *, stream: bool = False) -> ClientConfig:
    return ClientConfig(
        endpoints=[url],
        stream=stream,
        timeouts=Timeouts(connect_s=1, attempt_s=30, deadline_s=30, cut_grace_s=grace_s),
        health=HealthSettings(interval_s=0.05),
    )


def client_ports(server_url: str) -> set[int]:
    """Local ports of the established TCP connections to the server's port (IPv4 loopback)."""
    server_port = int(server_url.rsplit(":", 1)[1])
    ports: set[int] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state == "01" and int(remote.split(":")[1], 16) == server_port:
            ports.add(int(local.split(":")[1], 16))
    return ports


async def aborted(server_url: str) -> float:
    """The replica's count of requests it aborted because their client went away."""
    return await served_total(f"{server_url}/metrics", "sim_request_errors_total", reason="aborted")


async def aborted_once(server_url: str) -> None:
    """Until the replica aborted the one request (at its next disconnect poll)."""

    async def once() -> bool:
        return await aborted(server_url) == 1

    await until(once, 3.0)


async def cut(client: LLMClient, deadline_s: float = 0.15) -> None:
    with pytest.raises(DeadlineExceeded):
        await client.chat(MESSAGES, routing_key="s1", max_tokens=200, deadline_s=deadline_s)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_answered_within_the_grace_keeps_its_connection_for_the_next_call(stream: bool) -> None:
    async with (
        running_simulator(time_scale=FAST) as sim,
        LLMClient(config(sim.url, grace_s=5.0, stream=stream)) as client,
    ):
        await cut(client)
        assert client.cut_calls.reading == 1, "the caller waited for the whole answer"
        assert client.in_flight == 1, "a call reading on holds its replica's slot: it is in flight"
        await until(lambda: client.cut_calls.kept == 1, 5.0)
        assert client.in_flight == 0
        kept = client_ports(sim.url)
        assert len(kept) == 1, kept
        assert await aborted(sim.url) == 0, "the replica saw the client go away"
        await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
        assert client_ports(sim.url) == kept, "the next call opened a new connection"
        assert (client.cut_calls.closed, client.cut_calls.failed, client.cut_calls.reading) == (0, 0, 0)


async def test_without_a_grace_a_cut_call_closes_its_connection_and_the_replica_aborts_it() -> None:
    async with running_simulator(time_scale=FAST) as sim, LLMClient(config(sim.url, grace_s=0.0)) as client:
        await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
        first = client_ports(sim.url)
        assert len(first) == 1
        await cut(client)
        await until(lambda: not client_ports(sim.url), 1.0)
        await client.chat(MESSAGES, routing_key="s1", max_tokens=5)
        assert client_ports(sim.url).isdisjoint(first), "a closed connection was used again"
        await aborted_once(sim.url)
        assert (client.cut_calls.kept, client.cut_calls.closed, client.cut_calls.reading) == (0, 0, 0)


async def test_an_answer_slower_than_the_grace_is_cut_again_and_the_replica_aborts_it() -> None:
    async with running_simulator(time_scale=SLOW) as sim, LLMClient(config(sim.url, grace_s=0.2)) as client:
        await cut(client, deadline_s=0.3)
        assert client.cut_calls.reading == 1
        await until(lambda: client.cut_calls.closed == 1, 2.0)
        assert not client_ports(sim.url), "a connection outlived its grace"
        # trtllm-serve, and the simulator, notice a gone client at their next poll (1 s at this scale)
        await aborted_once(sim.url)
        assert client.cut_calls.kept == 0


async def test_closing_the_client_closes_the_calls_still_reading() -> None:
    async with running_simulator(time_scale=SLOW) as sim:
        client = LLMClient(config(sim.url, grace_s=30.0))
        await client.start()
        await cut(client, deadline_s=0.3)
        assert client.cut_calls.reading == 1
        await client.close()
        assert (client.cut_calls.reading, client.cut_calls.closed) == (0, 1)
        await until(lambda: not client_ports(sim.url), 1.0)
        await aborted_once(sim.url)


async def test_while_cut_calls_outlive_the_grace_later_ones_close_at_once_but_for_a_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cut_calls, "PROBE_INTERVAL_S", 60.0)  # probes by count alone here
    async with running_simulator(time_scale=SLOW) as sim, LLMClient(config(sim.url, grace_s=0.05)) as client:
        cuts = client.cut_calls
        await cut(client, deadline_s=0.1)
        await until(lambda: cuts.closed == 1, 2.0)
        assert not cuts.paying
        for _ in range(PROBE_EVERY):
            await cut(client, deadline_s=0.1)
        assert cuts.closed_at_once == PROBE_EVERY - 1, vars(cuts)
        await until(lambda: cuts.closed == 2, 2.0)
        assert cuts.kept == 0 and not cuts.paying
        await until(lambda: not client_ports(sim.url), 1.0)


async def test_a_cut_call_long_after_the_last_that_read_on_reads_on_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where few calls are cut, the count alone would take many cuts to find out the fleet caught up.
    monkeypatch.setattr(cut_calls, "PROBE_INTERVAL_S", 1.0)  # wide enough for a stalled host
    async with running_simulator(time_scale=SLOW) as sim, LLMClient(config(sim.url, grace_s=0.05)) as client:
        cuts = client.cut_calls
        await cut(client, deadline_s=0.1)
        await until(lambda: cuts.closed == 1, 2.0)
        await cut(client, deadline_s=0.1)
        assert cuts.closed_at_once == 1 and cuts.reading == 0
        await asyncio.sleep(1.1)
        await cut(client, deadline_s=0.1)
        assert cuts.reading == 1 and cuts.closed_at_once == 1, vars(cuts)


class _CallerState:
    """Something a caller holds while it waits (a real-time request and its candidates)."""


async def test_a_call_cut_within_a_grace_frees_its_caller_at_once() -> None:
    # The exchange reading on must not hold the caller's frame: the caller's state is freed by
    # reference counting as soon as it has its error, while the exchange is still reading.
    async with running_simulator(time_scale=FAST) as sim, LLMClient(config(sim.url, grace_s=5.0)) as client:

        async def ask(state: _CallerState) -> None:
            await cut(client)

        with collector_off():
            state = _CallerState()
            held = weakref.ref(state)
            await ask(state)
            del state
            assert client.cut_calls.reading == 1
            assert held() is None
        await until(lambda: client.cut_calls.kept == 1, 5.0)


async def test_a_call_that_fails_with_a_grace_frees_its_caller_at_once() -> None:
    # The exchange's error is raised from the task it ran in: the frame that raises it must not keep
    # that task, which holds the error, or the error's traceback closes a cycle over the caller's frames.
    async with running_simulator(time_scale=FAST) as sim, LLMClient(config(sim.url, grace_s=5.0)) as client:

        async def ask(state: _CallerState) -> None:
            try:
                await client.chat(MESSAGES, routing_key="s1", max_tokens=-5)
            except BadRequest:
                return
            raise AssertionError("the replica took max_tokens=-5")

        with collector_off():
            state = _CallerState()
            held = weakref.ref(state)
            await ask(state)
            del state
            assert held() is None, "a failed call's error kept its caller's frame"


async def test_a_replica_slower_than_every_deadline_is_drained_by_its_answers_within_the_grace() -> None:
    # Two replicas answer within the callers' deadline; the third takes several times as long, so
    # every call to it is cut and its answer comes within the grace. Before, only a call that beat its
    # deadline taught the degradation detector, so this replica gave no latency sample, was never
    # judged, and kept taking its share of the calls, each one answered too late to use.
    async with (
        running_simulator(time_scale=0.02) as fast_a,
        running_simulator(time_scale=0.02) as fast_b,
        running_simulator(time_scale=0.5) as slow,
    ):
        urls = [fast_a.url, fast_b.url, slow.url]
        settings = ClientConfig(
            endpoints=urls,
            policy="round_robin",
            stream=False,
            timeouts=Timeouts(connect_s=1, attempt_s=30, deadline_s=30, cut_grace_s=2.0),
            retry=RetrySettings(max_attempts=1),
            health=HealthSettings(interval_s=0.05),
        )
        async with LLMClient(settings) as client:
            await client.wait_until_healthy()
            # One call to each replica (round robin): the fast ones' time and the slow one's.
            times = [await timed_call(client, f"warm-up-{i}", deadline_s=10) for i in range(3)]
            assert max(times) > 3 * min(times), times
            deadline_s = (min(times) * max(times)) ** 0.5
            slow_endpoint = next(e for e in client.endpoints if e.url == slow.url)
            cut_calls = 0
            for batch in range(40):
                outcomes = await asyncio.gather(
                    *(timed_call(client, f"s{batch}-{i}", deadline_s) for i in range(3)),
                    return_exceptions=True,
                )
                cut_calls += sum(isinstance(o, DeadlineExceeded) for o in outcomes)
                if slow_endpoint.drained:
                    break
            await until(lambda: client.cut_calls.reading == 0, 5.0)
        assert cut_calls > 0, "no call was cut: the slow replica is not slower than the deadline"
        assert client.cut_calls.kept > 0, "no cut call was answered within the grace"
        assert slow_endpoint.drained, (
            f"the slow replica was not drained after {cut_calls} cut calls "
            f"({client.cut_calls.kept} answered within the grace)"
        )
        assert not any(e.drained for e in client.endpoints if e is not slow_endpoint)


async def timed_call(client: LLMClient, key: str, deadline_s: float) -> float:
    started = asyncio.get_running_loop().time()
    await client.chat(MESSAGES, routing_key=key, max_tokens=20, deadline_s=deadline_s)
    return asyncio.get_running_loop().time() - started
