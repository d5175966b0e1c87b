"""The replicas, and the one place where what the client learns about them is written down.

``Endpoint`` is mutated only here (on the event loop): the routing policy, the degradation detector and
the answer health report what they learned (``Feedback``, ``HealthChange``, ``Quarantine``) and the fleet
records it. Every attempt ends in exactly one of ``succeeded``, ``failed`` or ``bad_answer``; whatever
else happens to a replica (ejection, quarantine, re-admission) follows from those and from the health
checks (``llm_client.health_checks``).

With P/D disaggregation the fleet has two pools: ``endpoints`` (generation servers, or every replica
without P/D) and ``context_endpoints`` (context servers, routed by the P/D policy's context part).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

from llm_client.answer_health import AnswerHealth, Quarantine
from llm_client.config import ClientConfig
from llm_client.degradation import DegradationDetector, apply_health_changes
from llm_client.endpoints import Endpoint, endpoint_name
from llm_client.errors import ConnectionFailed, InvalidAnswer, LLMError, NoHealthyEndpoint, Overloaded
from llm_client.routing import RouteOutcome, RouteRequest, RoutingPolicy
from llm_client.routing.base import prefill_observer
from llm_client.routing.pd_aware import PdAwarePolicy

log = logging.getLogger("llm_client.client")
"""Ejections are logged under the client's name, where operators have always looked for them."""


class Fleet:
    """The replicas' state and its only writer."""

    def __init__(
        self,
        config: ClientConfig,
        policy: RoutingPolicy,
        degradation: DegradationDetector,
        answer_health: AnswerHealth,
    ) -> None:
        self.config = config
        self.policy = policy
        self.degradation = degradation
        self.answer_health = answer_health
        self.endpoints = [Endpoint(url.rstrip("/"), endpoint_name(url)) for url in config.endpoints]
        self.context_endpoints = [
            Endpoint(url.rstrip("/"), endpoint_name(url)) for url in config.context_endpoints
        ]
        self._departed: dict[str, Endpoint] = {}
        """Replicas dropped while attempts still ran on them, by URL (``set_endpoints``)."""
        self._cuts: dict[str, asyncio.TimerHandle] = {}
        """The withdrawals planned for dropped replicas, by URL, until they run."""
        self.on_forget: list[Callable[[Endpoint], None]] = []
        """Told when a replica leaves the fleet (``set_endpoints``): per-replica state kept elsewhere
        (``AnswerProber``) goes with it."""

    @property
    def every(self) -> list[Endpoint]:
        return [*self.endpoints, *self.context_endpoints]

    def set_endpoints(
        self, urls: Sequence[str], *, withdraw_after_s: float | Mapping[str, float] | None = None
    ) -> None:
        """Route to exactly ``urls`` from now on. Kept replicas keep their state; new ones start fresh;
        dropped ones are forgotten by the routing policy, the answer health and the degradation
        detector. ``withdraw_after_s``: the attempts still running on a dropped replica that long from
        now (one time for all, or one per URL; a URL not named is left alone) are cut and moved to a
        kept one (``Withdrawn``): its new owner gets it free. None lets them finish. A replica that
        comes back while calls of its earlier stay still run takes them with it: a later drop cuts
        them too."""
        wanted = [u.rstrip("/") for u in urls]
        if isinstance(withdraw_after_s, Mapping):
            withdraw_after_s = {u.rstrip("/"): t for u, t in withdraw_after_s.items()}
        current = {e.url: e for e in self.endpoints}
        for url, endpoint in current.items():
            if url not in wanted:
                endpoint.left = True
                self.policy.forget(endpoint)
                self.answer_health.forget(endpoint)
                self.degradation.forget(endpoint)
                for forget in self.on_forget:
                    forget(endpoint)
                self._departed[url] = endpoint
                self._cancel_cut(url)  # the newest drop says when, or whether, its calls are cut
                after_s = (
                    withdraw_after_s.get(url) if isinstance(withdraw_after_s, Mapping) else withdraw_after_s
                )
                if after_s is not None:
                    loop = asyncio.get_running_loop()
                    self._cuts[url] = loop.call_later(max(0.0, after_s), self._withdraw, endpoint)
        self.endpoints = [current.get(url) or self._returning(url) for url in wanted]
        for url in [u for u, e in self._departed.items() if not e.attempts]:
            del self._departed[url]

    def _returning(self, url: str) -> Endpoint:
        """A fresh ``Endpoint`` for ``url``, holding the attempts still running from its last stay."""
        endpoint = Endpoint(url, endpoint_name(url))
        self._cancel_cut(url)  # back before its cut: its calls are this side's again
        if (earlier := self._departed.pop(url, None)) is not None:
            endpoint.attempts, endpoint.withdrawn = earlier.attempts, earlier.withdrawn
        return endpoint

    def _cancel_cut(self, url: str) -> None:
        if (pending := self._cuts.pop(url, None)) is not None:
            pending.cancel()

    def _withdraw(self, endpoint: Endpoint) -> None:
        """Cut the attempts still running on ``endpoint``, which left the fleet, and any that reach it
        from now (a cut planned before it came back, or before a later drop, was cancelled then)."""
        del self._cuts[endpoint.url]
        endpoint.cut_off = True
        if endpoint.attempts:
            log.info(
                "withdrawing %d call(s) from %s, which left the fleet", len(endpoint.attempts), endpoint.name
            )
        for task in endpoint.attempts:
            if task not in endpoint.withdrawn:
                endpoint.withdrawn.add(task)
                task.cancel()

    # ---- which pool, which policy ----------------------------------------------------------------
    def policy_of(self, endpoint: Endpoint) -> RoutingPolicy:
        """The policy that routes to ``endpoint``: a P/D policy's context part for a context server."""
        if isinstance(self.policy, PdAwarePolicy) and any(endpoint is c for c in self.context_endpoints):
            return self.policy.context
        return self.policy

    def peers(self, endpoint: Endpoint) -> list[Endpoint]:
        """The pool ``endpoint`` belongs to (context servers, or the others)."""
        contexts = self.context_endpoints
        return contexts if any(endpoint is c for c in contexts) else self.endpoints

    def choose(self, route: RouteRequest, tried: Sequence[str]) -> Endpoint:
        """The policy's pick among routable replicas not yet tried (all routable ones when every one
        was tried)."""
        servable = self.servable()
        candidates = [e for e in servable if e.name not in tried] or servable
        if not candidates:
            raise NoHealthyEndpoint(f"all {len(self.endpoints)} replicas are ejected or quarantined")
        return self.policy.choose(route, candidates)

    def servable(self) -> list[Endpoint]:
        """The routable replicas; when none is, the healthy ones the degradation detector drained. A
        drained replica is slow, not broken: the detector drains only while enough others remain, and
        when those are ejected after (a restart, a crash), it is the one that still answers. It stayed
        out for its whole cool-down (30 s, doubling to 600 s), every call waiting for a re-admission
        until its deadline. A quarantined replica (bad answers) is never a fallback."""
        routable = [e for e in self.endpoints if e.routable]
        if routable:
            return routable
        return [e for e in self.endpoints if e.healthy and e.drained and not e.quarantined]

    async def wait_for_routable(self) -> None:
        """No replica can serve (every one ejected or quarantined): wait (within the caller's deadline)
        for the health checker to re-admit one, instead of failing every request of a short outage."""
        while not self.servable():
            await asyncio.sleep(self.config.health.interval_s / 2)

    def prefill_reporter(self, route: RouteRequest, endpoint: Endpoint) -> Callable[[bool], None] | None:
        """How an attempt tells a ``PrefillObserver`` policy its prefill is over: computed (a first token
        came) or abandoned (it ended without one); None for a policy that does not listen."""
        policy = self.policy_of(endpoint)
        observer = prefill_observer(policy)
        if observer is None:
            return None

        def report(computed: bool) -> None:
            if computed:
                observer.prefill_done(route, endpoint)
            else:
                observer.prefill_abandoned(route, endpoint)

        return report

    # ---- how an attempt ended --------------------------------------------------------------------
    def succeeded(self, endpoint: Endpoint, route: RouteRequest, outcome: RouteOutcome) -> None:
        """A usable answer: counted as a good answer, as latency, and taught to the policy; nothing of
        it by a replica that left the fleet meanwhile (its call ran on): learned after ``forget``, it
        brought back the replica's cache picture, latency samples and answer window, found again
        when its address came back (capacity shifting moves the same addresses between pools)."""
        if endpoint.left:
            return
        self.answer_health.observe(endpoint, self.peers(endpoint), None)
        endpoint.record_success(outcome.latency_ms, outcome.ttft_ms)
        self.degradation.observe_success(
            endpoint,
            outcome.latency_ms,
            prompt_tokens=outcome.prompt_tokens,
            cached_tokens=outcome.cached_tokens,
            completion_tokens=outcome.completion_tokens,
        )
        self.evaluate_health()
        self.observe(route, endpoint, outcome)

    def attempt_failed(self, endpoint: Endpoint, route: RouteRequest, error: LLMError) -> None:
        """How a retryable error of one attempt counts: a refusal for load (``Overloaded``) against
        nothing (``refused``), any other against the replica (``failed``)."""
        if isinstance(error, Overloaded):
            self.refused(endpoint, route)
        elif error.retryable:
            self.failed(endpoint, route, connection=isinstance(error, ConnectionFailed))

    def refused(self, endpoint: Endpoint, route: RouteRequest) -> None:
        """The replica refused for load (a 429): alive and working, so no failure is recorded, nothing
        is ejected or drained; only the policy learns that this request was not served there."""
        if endpoint.left:
            return
        endpoint.refused += 1
        self.observe(route, endpoint, RouteOutcome(ok=False))

    def failed(self, endpoint: Endpoint, route: RouteRequest, *, connection: bool) -> None:
        """A retryable failure (5xx, timeout, broken connection): a failed connection ejects at
        once, other failures after ``eject_after_failures`` in a row."""
        if endpoint.left:
            return
        endpoint.record_failure()
        self.observe(route, endpoint, RouteOutcome(ok=False, connection_failed=connection))
        self.degradation.observe_failure(endpoint)
        self.evaluate_health()
        limit = self.config.health.eject_after_failures
        if endpoint.healthy and (connection or endpoint.consecutive_failures >= limit):
            self.eject(
                endpoint,
                "connection failed" if connection else f"{endpoint.consecutive_failures} failures in a row",
            )

    def bad_answer(self, endpoint: Endpoint, route: RouteRequest, error: InvalidAnswer) -> Quarantine | None:
        """An answer that is no answer: counted by kind, taught to the policy (the replica holds nothing
        known for this prompt), and judged by the answer health, which may quarantine the replica."""
        if endpoint.left:
            return None
        endpoint.failed += 1
        endpoint.invalid_answers[error.kind] = endpoint.invalid_answers.get(error.kind, 0) + 1
        self.observe(route, endpoint, RouteOutcome(ok=False))
        self.degradation.observe_failure(endpoint)
        quarantine = self.answer_health.observe(endpoint, self.peers(endpoint), error.kind, str(error))
        if quarantine is not None:
            endpoint.quarantined = True
            endpoint.quarantine_kind = quarantine.reason
            endpoint.out_reason = f"bad answers ({quarantine.reason}): {quarantine.detail}"
            self.policy_of(endpoint).forget(endpoint)
        return quarantine

    def observe(self, route: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> None:
        """Teach the policy, and record on the replica what it learned."""
        if self.policy_of(endpoint).observe(route, endpoint, outcome).restart_detected:
            endpoint.restarts_detected += 1

    def blocks_gone(self, context: Endpoint) -> None:
        """A P/D hand-over found the prompt's blocks gone at the pull (``kv_cache_gone``): ``context``
        did not deliver what it answered for (it restarted, could not be reached, or let them go), so
        it counts as a failure of that context server for the degradation detector, judged against its
        context peers (a pool-wide cause, decode servers pulling late, raises every peer alike and
        drains none). Not towards ejection: its prefill answered, and ``/health`` would re-admit it."""
        if context.left:
            return
        self.degradation.observe_failure(context)
        self.evaluate_health()

    def evaluate_health(self) -> None:
        """Let the degradation detector judge the replicas, and apply its drains and re-admissions.
        Each pool is judged apart: a P/D context server against its context peers (a prefill's
        latency per unit of work is not a decode's), with the detector's ``min_routable`` and
        ``max_drained_fraction`` counted within that pool."""
        for pool in (self.endpoints, self.context_endpoints):
            if pool:
                apply_health_changes(pool, self.degradation.evaluate(pool))

    # ---- out of rotation and back ----------------------------------------------------------------
    def eject(self, endpoint: Endpoint, reason: str = "ejected") -> None:
        endpoint.healthy = False
        endpoint.ejections += 1
        endpoint.out_reason = reason
        log.warning("ejecting replica %s until /health answers: %s", endpoint.name, reason)
        self.policy_of(endpoint).forget(endpoint)

    def readmit(self, endpoint: Endpoint) -> None:
        """``/health`` answered: the replica takes traffic again."""
        endpoint.healthy = True
        endpoint.consecutive_failures = 0

    def lift_quarantine(self, endpoint: Endpoint) -> None:
        """An answer probe passed: re-admitted on probation (``AnswerHealth.probe_passed``)."""
        self.answer_health.probe_passed(endpoint)
        endpoint.quarantined = False
