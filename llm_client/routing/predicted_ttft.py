"""Routing by predicted time to first token, over replicas of different speeds in several regions.

A fleet is rarely uniform: two accelerator kinds, replicas in regions tens of milliseconds apart. So
the cost of a candidate is not a token count but the time its first token would take::

    predicted_ttft(r) = rtt(group(r)) + slowness(r) * (floor + prior_ms_per_token(r) * work(r))
    work(r) = queued_tokens(r) + uncached_tokens(prompt, r)

- ``queued_tokens`` is the prefill (and weighted decode) work already routed there and not done, as
  ``PrefixAwarePolicy.load`` counts it; ``uncached_tokens`` credits the prefix the replica is believed to
  hold (its block index: approximate, or precise with KV cache events);
- ``prior_ms_per_token`` is the prefill speed of the replica's accelerator kind (its group's
  ``ms_per_token``, from that kind's calibration), and ``floor`` (``first_token_floor_ms``) what any
  first token costs however little work is ahead of it (the engine iteration it waits for);
- ``slowness`` is learned from every first token the replica sends back: an EWMA (of logs) of the
  observed ``ttft - rtt`` over what the prior predicted for the same work, so a slow or degraded replica is
  weighed as it is. Learning the ratio to a model with a floor, rather than milliseconds per token of
  work, keeps a replica with little work ahead (an idle one, a warm prompt) from looking slow. The work
  is what ``prefix_aware`` expected for the replica chosen (``estimate_uncached_tokens``, also what the
  client counts in its load): where a sibling prompt of the shopper is still queued there, the raw block
  index believes a hit the replica cannot give, and learning against it made a hot shopper's replica
  look twice as slow as it is;
- ``rtt`` is the round trip to the replica's endpoint group (a region or zone).

Prediction decides who *may* serve: every candidate predicted to meet ``slo_ms`` (or, when none does,
within ``admit_slack`` x the best prediction) is admissible. ``PrefixAwarePolicy`` chooses among them
with its cache credit and load guards, its token costs turned into time at each replica's speed and
round trip (``time_of``): the least predicted time wins, so a replica twice as slow takes a request only
when its queue is less than half as long, and shoppers keep their warm replicas. Its bounded load is in
capacity shares (``capacity_of``): a replica twice as fast may hold twice the requests in flight before
its shoppers are moved off their cache.

Spreading over groups (the traffic orchestrator of the fleet this project answers): requests stay in
the ``local_group`` while its best prediction for a *typical* request (``typical_ttft_ms``: the queued
work plus a typical request's own prefill, an EWMA of requests' uncached tokens at home) is under
``spill_ratio * slo_ms`` (a typical first token, the SLO a p99: the margin is what holds the tail); past
it the policy *spills*. It comes back only once that prediction is under ``return_ratio * slo_ms`` and at
least ``min_spill_s`` after it left: that gap is the hysteresis that keeps a surge at the threshold from
flapping. So the state follows the local load, not the size of the request at hand: decided on each
request's own prediction, one cold 6k-token prompt on an idle fleet spilled every request for
``min_spill_s``, and only a request predicted under the return threshold brought it back.

Where each request goes while spilled is decided per request: a request warm at home that some local
replica can still serve within the SLO stays local; one cold at home (a full prefill anywhere) or that
would miss competes over every group with a non-zero weight (prediction divided by weight). So the
heaviest prefills leave the hot region first, and warm shoppers neither wait nor pay a cold prefill
elsewhere. A shopper whose blocks are warm in another region keeps going there while
spilled (that replica stays a candidate, and its cache credit wins), so KV affinity survives the spill;
once local is calm again, shoppers come home.

Group weights are live: ``set_group_weight`` (the gateway's admin endpoint calls it) changes how much a
group is preferred, and 0 takes it out of rotation. Pure and synchronous, like every policy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llm_client.endpoints import Endpoint
from llm_client.routing.base import Feedback, RouteOutcome, RouteRequest
from llm_client.routing.prefix_aware import PrefixAwarePolicy, PrefixAwareSettings
from prompt_assembly.errors import ConfigurationError

MAX_GROUP_WEIGHT = 10.0
"""The largest group weight. A weight divides a group's predicted first-token time: 10 already prefers a
group over one ten times faster. Without a bound a weight of ``Infinity`` (or ``1e309``, which JSON reads
as infinity) made every prediction of the group 0, so it was admissible however slow it became."""

_PREDICTED = "predicted_ttft.work"
"""Per replica the request was routed to: (work tokens, rtt ms) at routing time, to learn its speed."""


class EndpointGroup(BaseModel):
    """Replicas that share a network location (a region or zone)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    endpoints: list[str] = Field(description="replica base URLs in this group (as in ClientConfig.endpoints)")
    rtt_ms: float = Field(0.0, ge=0, description="round trip from this client to the group")
    weight: float = Field(
        1.0,
        ge=0,
        le=MAX_GROUP_WEIGHT,
        allow_inf_nan=False,
        description="preference when spilled (prediction / weight); 0 = out",
    )
    ms_per_token: float | None = Field(
        None, gt=0, description="prior prefill speed of its accelerator kind; None = the policy's default"
    )

    @field_validator("endpoints")
    @classmethod
    def _as_the_client_names_them(cls, endpoints: list[str]) -> list[str]:
        """The client drops a URL's trailing slash (``Endpoint.url``): a group URL written with one
        matched no replica, and its replica silently counted as local, at a round trip of 0."""
        return [url.rstrip("/") for url in endpoints]


class PredictedTtftSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    policy: Literal["predicted_ttft"] = "predicted_ttft"
    prefix: PrefixAwareSettings = Field(
        default_factory=PrefixAwareSettings, description="the block index and load accounting"
    )
    groups: list[EndpointGroup] = Field(
        default_factory=list, description="endpoint groups; a replica in none is in the local group"
    )
    local_group: str = Field("local", description="the group this client runs next to")
    slo_ms: float = Field(1000.0, gt=0, description="the time to first token to hold (p99 target)")
    spill_ratio: float = Field(
        0.8,
        gt=0,
        le=1,
        description="spill when the local prediction for a typical request (typical_ttft_ms) passes this "
        "x slo_ms: a prediction is a typical first token, and the SLO a p99, so the decision keeps a margin",
    )
    return_ratio: float = Field(
        0.6,
        gt=0,
        le=1,
        description="come back when the local prediction for a typical request is under this x slo_ms",
    )
    typical_prefill_alpha: float = Field(
        0.05,
        gt=0,
        le=1,
        description="EWMA weight of each request's own prefill (its uncached tokens at its best local "
        "replica; from 0) in the typical request the spill state is decided for. One long cold prompt "
        "moves it by this share; at 1 the state followed each request's size, and one cold 6k-token prompt "
        "on an idle fleet spilled every request for min_spill_s",
    )
    min_spill_s: float = Field(10.0, ge=0, description="stay spilled at least this long (no flapping)")
    ms_per_token: float = Field(
        0.122,
        gt=0,
        description=(
            "default prior, learned over: a 32B model's prefill on an H100 (the eager table's"
            " serving/simulator/calibration_h100.json; benchmarks pass their replicas' own cost model)"
        ),
    )
    first_token_floor_ms: float = Field(
        100.0,
        ge=0,
        description="what a first token costs with no work ahead: the engine iteration it waits for "
        "(a decode step plus a short prefill iteration; the default is a prior for a 32B model on an H100)",
    )
    speed_alpha: float = Field(
        0.05,
        gt=0,
        le=1,
        description="EWMA weight of each learned slowness sample (in log space). One first token is a "
        "noisy sample (where in an engine iteration it landed, the batch it joined): at 0.2 two fast "
        "replicas of one fleet were learned 1.25x and 2.5x as slow at the same moment, and warm shoppers "
        "were moved off their cache for it",
    )
    speed_half_life_s: float = Field(
        60.0, gt=0, description="a learned speed with no new sample relaxes to the prior with this half-life"
    )
    admit_slack: float = Field(
        1.25,
        ge=1,
        description="when no replica is predicted to meet slo_ms, those within this x the best prediction "
        "are admissible",
    )
    min_work_tokens: int = Field(
        256, ge=1, description="a first token after less work than this teaches nothing about speed"
    )

    @model_validator(mode="after")
    def _return_below_spill(self) -> PredictedTtftSettings:
        if self.return_ratio >= self.spill_ratio:
            raise ConfigurationError(
                f"return_ratio {self.return_ratio} must be under spill_ratio {self.spill_ratio} (hysteresis)"
            )
        return self

    @model_validator(mode="after")
    def _each_endpoint_once(self) -> PredictedTtftSettings:
        seen: dict[str, str] = {}
        for group in self.groups:
            for url in group.endpoints:
                if url in seen:
                    raise ConfigurationError(f"endpoint {url} is in groups {seen[url]} and {group.name}")
                seen[url] = group.name
        return self


@dataclass(slots=True)
class PredictedTtftStats:
    spills: int = 0
    """Times the local group stopped meeting the SLO and requests began to go elsewhere."""
    returns: int = 0
    routed_remote: int = 0
    routed_local: int = 0
    spilled_requests: int = 0
    """Requests routed while spilled over every group: cold at home, or no local replica could serve
    them within the SLO."""
    kept_local_while_spilled: int = 0
    """Requests routed while spilled that stayed local: a local replica met the SLO for them."""
    speed_samples: int = 0


class PredictedTtftPolicy:
    name: ClassVar[str] = "predicted_ttft"
    settings_type: ClassVar[type[BaseModel]] = PredictedTtftSettings

    def __init__(
        self,
        settings: PredictedTtftSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        **knobs: Any,
    ) -> None:
        if settings is None or knobs:
            base = settings.model_dump() if settings is not None else {}
            settings = PredictedTtftSettings.model_validate({**base, **knobs})
        self.settings = settings
        self.prefix = PrefixAwarePolicy(settings.prefix, clock=clock)
        self._clock = clock
        self._group_of = {url: group for group in settings.groups for url in group.endpoints}
        self._weights = {group.name: group.weight for group in settings.groups}
        self._weights.setdefault(settings.local_group, 1.0)
        self._slowness: dict[str, tuple[float, float]] = {}
        """Per replica: learned slowness (observed over predicted first-token time), and when."""
        self.typical_uncached_tokens = 0.0
        """A typical request's own prefill at home (EWMA over requests' first routings): with the
        queues, what the spill state is decided on."""
        self.spilled_since: float | None = None
        self.stats = PredictedTtftStats()

    # ---- groups --------------------------------------------------------------------------------
    def group(self, endpoint: Endpoint) -> str:
        found = self._group_of.get(endpoint.url)
        return self.settings.local_group if found is None else found.name

    def rtt_ms(self, endpoint: Endpoint) -> float:
        found = self._group_of.get(endpoint.url)
        return 0.0 if found is None else found.rtt_ms

    def group_weights(self) -> dict[str, float]:
        return dict(self._weights)

    def set_group_weight(self, group: str, weight: float) -> None:
        """Change a group's weight live (0 takes it out of rotation)."""
        if group not in self._weights:
            raise ConfigurationError(f"unknown endpoint group {group!r}; known: {sorted(self._weights)}")
        if not 0 <= weight <= MAX_GROUP_WEIGHT:  # NaN fails this too
            raise ConfigurationError(f"a group weight is finite, from 0 to {MAX_GROUP_WEIGHT}, not {weight}")
        self._weights[group] = weight

    @property
    def spilling(self) -> bool:
        return self.spilled_since is not None

    # ---- the prediction ------------------------------------------------------------------------
    def prior_ms_per_token(self, endpoint: Endpoint) -> float:
        found = self._group_of.get(endpoint.url)
        prior = None if found is None else found.ms_per_token
        return self.settings.ms_per_token if prior is None else prior

    def slowness(self, endpoint: Endpoint) -> float:
        """Observed first-token times over the prior's (1 = as the calibration says), relaxing back to 1
        with ``speed_half_life_s`` while no sample arrives: a replica that traffic avoided is tried
        again once what was learned has aged."""
        learned = self._slowness.get(endpoint.name)
        if learned is None:
            return 1.0
        value, at = learned
        decay: float = 0.5 ** ((self._clock() - at) / self.settings.speed_half_life_s)
        return 1.0 + (value - 1.0) * decay

    def ms_per_token(self, endpoint: Endpoint) -> float:
        """The replica's prefill speed as learned: its prior times its slowness."""
        return self.prior_ms_per_token(endpoint) * self.slowness(endpoint)

    def _prior_ms(self, endpoint: Endpoint, work: float) -> float:
        return self.settings.first_token_floor_ms + self.prior_ms_per_token(endpoint) * work

    def work_tokens(self, request: RouteRequest, endpoint: Endpoint) -> float:
        uncached = request.prompt_tokens - self.prefix.cached_tokens(request, endpoint)
        return self.prefix.load(endpoint) + uncached

    def predicted_ttft_ms(self, request: RouteRequest, endpoint: Endpoint) -> float:
        return self._time_of(endpoint, self.work_tokens(request, endpoint))

    def typical_ttft_ms(self, endpoint: Endpoint) -> float:
        """The prediction for a typical request (``typical_uncached_tokens``) rather than this one: the
        replica's load in time, which the size of the request at hand does not move."""
        return self._time_of(endpoint, self.prefix.load(endpoint) + self.typical_uncached_tokens)

    # ---- RoutingPolicy -------------------------------------------------------------------------
    def choose(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Endpoint:
        if not endpoints:
            raise ValueError("choose() needs at least one endpoint")
        predicted = {e.name: self.predicted_ttft_ms(request, e) for e in endpoints}
        local_name = self.settings.local_group
        local = [e for e in endpoints if self.group(e) == local_name and self._weights[local_name] > 0]
        best_local = min(local, key=lambda e: predicted[e.name], default=None)
        if _PREDICTED not in request.memo:
            # A retry's candidates leave out the replicas it already tried: one 503 from the only local
            # replica would read as "no local replica" and spill every request for min_spill_s. The
            # spill state is the fleet's, so only a request's first routing (all routable replicas)
            # moves it, and for a typical request: this one's own prefill is no load.
            if best_local is not None:
                own = request.prompt_tokens - self.prefix.cached_tokens(request, best_local)
                self.typical_uncached_tokens += self.settings.typical_prefill_alpha * (
                    own - self.typical_uncached_tokens
                )
            self._update_spill(min((self.typical_ttft_ms(e) for e in local), default=float("inf")))
        slo = self.settings.slo_ms
        if best_local is not None and not self.spilling:
            pool = local
        else:
            pool = self._spill_pool(request, endpoints, local, predicted)
        scored = {e.name: predicted[e.name] / max(self._weights.get(self.group(e), 0.0), 1e-9) for e in pool}
        # Every replica predicted to meet the SLO (or, if none does, near the best) is admissible, and
        # prefix_aware chooses among them with its cache credit and load guards, its costs turned into
        # time at each replica's speed and round trip.
        best = min(scored.values())
        bound = max(slo, best * self.settings.admit_slack)
        admissible = [e for e in pool if scored[e.name] <= bound]
        chosen = self.prefix.choose(
            request, admissible, time_of=self._time_of, capacity_of=self._capacity
        )  # records the prompt
        if self.group(chosen) == local_name:
            self.stats.routed_local += 1
        else:
            self.stats.routed_remote += 1
        # The speed is learned against the work prefix_aware expects there (its co-batching discount and
        # pending rule applied), not the raw index: a sibling queued there makes the replica prefill
        # this prompt (nearly) cold, and the raw belief read every such first token as ~2x slow.
        expected = self.prefix.load(chosen) + self.prefix.estimate_uncached_tokens(request, chosen)
        work: dict[str, tuple[float, float]] = request.memo.setdefault(_PREDICTED, {})  # type: ignore[assignment]
        work[chosen.name] = (expected, self.rtt_ms(chosen))
        return chosen

    def _capacity(self, endpoint: Endpoint) -> float:
        """Relative prefill capacity (tokens per ms), for the load bound."""
        return 1.0 / self.ms_per_token(endpoint)

    def _time_of(self, endpoint: Endpoint, tokens: float) -> float:
        """A cost in prompt tokens of work, as time at ``endpoint``: its round trip plus its speed."""
        return self.rtt_ms(endpoint) + self.slowness(endpoint) * self._prior_ms(endpoint, tokens)

    def _spill_pool(
        self,
        request: RouteRequest,
        endpoints: Sequence[Endpoint],
        local: Sequence[Endpoint],
        predicted: dict[str, float],
    ) -> list[Endpoint]:
        """Where a request may go while spilled. Spilling is per request. A request warm at home
        that some local replica can still serve within the SLO stays local, so it pays no cold
        prefill elsewhere; a remote replica that holds more of this prompt than any local one (the
        shopper spilled there earlier) stays a candidate beside them, so affinity survives the spill.
        A request cold at home (it pays a full prefill anywhere) or that no local replica can serve
        in time competes over every group with a non-zero weight."""
        weighted = [e for e in endpoints if self._weights.get(self.group(e), 0.0) > 0] or list(endpoints)
        target = self.settings.spill_ratio * self.settings.slo_ms
        in_time = [e for e in local if predicted[e.name] <= target]
        held_locally = max((self.prefix.cached_tokens(request, e) for e in local), default=0)
        cold_here = held_locally < self.prefix.min_hit_fraction * request.prompt_tokens
        if not in_time or cold_here:
            # A request cold at home costs a full prefill wherever it goes: while the local group is
            # hot it goes where it is answered soonest, which takes the heaviest prefills off the
            # local queue first and keeps the warm shoppers there in time.
            self.stats.spilled_requests += 1
            return weighted
        warm_elsewhere = [
            e
            for e in weighted
            if self.group(e) != self.settings.local_group
            and self.prefix.cached_tokens(request, e) > held_locally
            and predicted[e.name] <= target
        ]
        self.stats.kept_local_while_spilled += not warm_elsewhere
        return [*local, *warm_elsewhere]  # the admission bound then applies to all of them

    def _update_spill(self, local_ms: float) -> None:
        now = self._clock()
        slo = self.settings.slo_ms
        if self.spilled_since is None:
            if local_ms > self.settings.spill_ratio * slo:
                self.spilled_since = now
                self.stats.spills += 1
        elif (
            local_ms <= self.settings.return_ratio * slo
            and now - self.spilled_since >= self.settings.min_spill_s
        ):
            self.spilled_since = None
            self.stats.returns += 1

    def estimate_uncached_tokens(self, request: RouteRequest, endpoint: Endpoint) -> int:
        return self.prefix.estimate_uncached_tokens(request, endpoint)

    def observe(self, request: RouteRequest, endpoint: Endpoint, outcome: RouteOutcome) -> Feedback:
        work_map = request.memo.get(_PREDICTED)
        routed = work_map.get(endpoint.name) if isinstance(work_map, dict) else None
        # Only a streamed first token says how long a first token took: a non-streamed answer's time
        # is its whole decode too (sixty 6.3 s answers taught 11x, and the policy stayed spilled).
        if outcome.ok and outcome.first_token and routed is not None and outcome.ttft_ms > 0:
            work, rtt = routed
            if work >= self.settings.min_work_tokens:
                sample = max(outcome.ttft_ms - rtt, 1.0) / self._prior_ms(endpoint, work)
                # A ratio: averaged in log space, so one 5x outlier moves it by 5**alpha, not 4 * alpha.
                before = math.log(self.slowness(endpoint))
                learned = math.exp(before + self.settings.speed_alpha * (math.log(sample) - before))
                self._slowness[endpoint.name] = (learned, self._clock())
                self.stats.speed_samples += 1
        return self.prefix.observe(request, endpoint, outcome)

    def forget(self, endpoint: Endpoint) -> None:
        """The replica restarted, was ejected or left: its learned slowness goes with its cache (a
        restarted replica is a new process; one ejected for being slow earns its slowness again)."""
        self.prefix.forget(endpoint)
        self._slowness.pop(endpoint.name, None)

    # ---- what the prefix bookkeeping needs (KvEventConsumer, PrefillObserver) --------------------
    @property
    def kv_event_poll_s(self) -> float | None:
        return self.prefix.kv_event_poll_s

    def apply_kv_events(self, endpoint: Endpoint, events: Sequence[Any]) -> None:
        self.prefix.apply_kv_events(endpoint, events)

    def prefill_done(self, request: RouteRequest, endpoint: Endpoint) -> None:
        self.prefix.prefill_done(request, endpoint)

    def prefill_abandoned(self, request: RouteRequest, endpoint: Endpoint) -> None:
        self.prefix.prefill_abandoned(request, endpoint)

    def attempt_over(self, request: RouteRequest, endpoint: Endpoint) -> None:
        self.prefix.attempt_over(request, endpoint)
