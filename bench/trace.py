"""A replayable trace of shopper-understanding prompts, built with the project's own prompt builder.

Synthetic shoppers browse a seasonal catalog (``devstack.synthetic.build_catalog``); their events go
through ``prompt_assembly.processor.SessionProcessor`` exactly as in the streaming job (event-time
triggers, prefix-stable prompts, head trimming), with the engine's timers emulated: a pending trigger
fires at its due time. So consecutive prompts of a shopper share what they share in production.

Shape (all deterministic in ``seed``):
- each shopper arrives with a history (``backlog_events`` earlier events, whose prompts are not part of
  the trace) so prompts are 2-4k tokens, then browses in bursts (a few seconds between events) separated
  by pauses longer than the browse-pause trigger, adding to cart now and then;
- a ``hot_fraction`` of shoppers (or exactly ``hot_count``) browse ``hot_factor`` times as many bursts;
  with ``hot_span_s`` their prompts are spread over that much time instead of their own (much longer)
  session, so a few shoppers make a large share of the prompts *at the same time* as everyone else
  (a skewed load); their long logs get trimmed at ``max_log_tokens`` over and over;
- ``with_poisson_arrivals`` replaces the natural prompt times by a Poisson process of a chosen rate,
  keeping the global (hence each shopper's) order, so utilisation is set exactly;
  ``with_onoff_arrivals`` does the same with bursts: ``peak_factor`` x the mean rate for ``on_fraction``
  of every ``period_s``, the rest of the period at the rate that keeps the mean.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from devstack.synthetic import Product, build_catalog
from prompt_assembly.events import ShopperEvent
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.records import ChatMessage, PromptRequest
from prompt_assembly.tokens import chained_block_hashes, messages_text, token_ids
from prompt_assembly.triggers import TriggerPolicy

START_TS = 1_761_800_000.0


@dataclass(frozen=True)
class TraceConfig:
    shoppers: int = 300
    hot_fraction: float = 0.05
    hot_factor: float = 4.0
    hot_count: int | None = None
    """Exactly this many hot shoppers (the first ones) instead of drawing ``hot_fraction``."""
    hot_span_s: float | None = None
    """Spread each hot shopper's prompts over this much time from its start (None: its natural times)."""
    bursts: tuple[int, int] = (2, 5)
    """Live browsing bursts per ordinary shopper (inclusive range)."""
    burst_events: tuple[int, int] = (3, 8)
    backlog_events: tuple[int, int] = (30, 45)
    session_spread_s: float = 1800.0
    """Shoppers' first live events are spread uniformly over this much event time."""
    max_log_tokens: int = 3600
    max_tokens: tuple[int, int] = (160, 240)
    seed: int = 7


@dataclass(frozen=True)
class TraceRequest:
    shopper_id: str
    seq: int
    t: float
    """Arrival, seconds from the trace start (simulated time)."""
    messages: list[ChatMessage]
    prompt_tokens: int
    max_tokens: int


def generate_trace(config: TraceConfig) -> list[TraceRequest]:
    rng = random.Random(config.seed)
    catalog = build_catalog(random.Random(config.seed + 1))
    categories = sorted(catalog)
    processor = SessionProcessor(
        SessionConfig(
            triggers=TriggerPolicy(quiet_period_s=20.0, min_prompt_interval_s=10.0),
            max_log_tokens=config.max_log_tokens,
            trim_to_fraction=0.6,
        )
    )
    all_out: list[tuple[float, PromptRequest, int]] = []
    for i in range(config.shoppers):
        out: list[tuple[float, PromptRequest, int]] = []
        shopper = _SyntheticShopper(f"shopper-{i:05d}", rng, catalog, rng.sample(categories, 2))
        session = processor.new_session(shopper.shopper_id)
        live_start = START_TS + rng.uniform(0, config.session_spread_s)
        hot = rng.random() < config.hot_fraction
        if config.hot_count is not None:
            hot = i < config.hot_count
        backlog = rng.randint(*config.backlog_events)
        ts = live_start - 3600.0
        for _ in range(backlog):  # history from an hour ago; its prompts are not in the trace
            processor.apply(session, shopper.event(ts, allow_cart=False))
            ts += rng.uniform(2.0, 8.0)
        processor.flush(session)
        bursts = rng.randint(*config.bursts)
        if hot:
            bursts = round(bursts * config.hot_factor)
        ts = live_start
        for _ in range(bursts):
            for _ in range(rng.randint(*config.burst_events)):
                pending = session.pending
                if pending is not None and pending.due_ts <= ts:
                    out += _timed(
                        processor.fire_pending(session, pending.due_ts), pending.due_ts, rng, config
                    )
                out += _timed(processor.apply(session, shopper.event(ts)).prompts, ts, rng, config)
                ts += rng.uniform(2.0, 10.0)
            ts += rng.uniform(25.0, 120.0)  # a pause: the browse-pause trigger fires in it
        pending = session.pending
        if pending is not None:
            out += _timed(processor.fire_pending(session, pending.due_ts), pending.due_ts, rng, config)
        if hot and config.hot_span_s is not None and out:
            span = max(out[-1][0] - live_start, 1e-9)
            out = [(live_start + (t - live_start) * config.hot_span_s / span, p, m) for t, p, m in out]
        all_out += out
    all_out.sort(key=lambda item: (item[0], item[1].request_id))
    t0 = all_out[0][0] if all_out else 0.0
    return [
        TraceRequest(p.shopper_id, p.seq, t - t0, p.messages, p.prompt_tokens, max_tokens)
        for t, p, max_tokens in all_out
    ]


def _timed(
    prompts: Sequence[PromptRequest], ts: float, rng: random.Random, config: TraceConfig
) -> list[tuple[float, PromptRequest, int]]:
    return [(ts, p, rng.randint(*config.max_tokens)) for p in prompts]


def with_poisson_arrivals(
    trace: Sequence[TraceRequest], rate_per_s: float, seed: int = 0
) -> list[TraceRequest]:
    """The same prompts in the same order, arriving as a Poisson process of ``rate_per_s``."""
    rng = random.Random(seed)
    t = 0.0
    timed = []
    for request in trace:
        t += rng.expovariate(rate_per_s)
        timed.append(replace(request, t=t))
    return timed


def with_onoff_arrivals(
    trace: Sequence[TraceRequest],
    mean_rate_per_s: float,
    *,
    peak_factor: float = 3.0,
    on_fraction: float = 0.25,
    period_s: float = 40.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """The same prompts in the same order, arriving in on/off bursts: a Poisson process whose rate is
    ``peak_factor`` x the mean for the first ``on_fraction`` of every ``period_s`` and low enough the
    rest of the period that the mean is ``mean_rate_per_s`` (so utilisation is the same as with
    ``with_poisson_arrivals``; only its timing differs)."""
    if not 1 <= peak_factor <= 1 / on_fraction:
        raise ValueError("peak_factor must be in [1, 1 / on_fraction]")
    on_s = on_fraction * period_s
    on_rate = peak_factor * mean_rate_per_s
    off_rate = mean_rate_per_s * (1 - peak_factor * on_fraction) / (1 - on_fraction)
    rng = random.Random(seed)
    t = 0.0
    timed = []
    for request in trace:
        work = rng.expovariate(1.0)  # unit-rate exponential, spent at the piecewise-constant rate
        while True:
            phase = t % period_s
            rate, end = (on_rate, on_s) if phase < on_s else (off_rate, period_s)
            left = end - phase
            if rate > 0 and work <= rate * left:
                t += work / rate
                break
            work -= rate * left
            t += left
        timed.append(replace(request, t=t))
    return timed


@dataclass(frozen=True)
class OracleBound:
    prompt_tokens: int
    prefill_tokens_global: int
    """Infinite cache shared by everyone: a prompt pays only what no earlier prompt had (lower bound of
    any routing over any number of replicas)."""
    prefill_tokens_per_shopper: int
    """Infinite cache, perfect affinity: a prompt pays what it does not share with its shopper's previous
    prompt (the oracle's definition; the shared system prompt is paid once per shopper)."""


def oracle_prefill(trace: Sequence[TraceRequest], block_size: int = 32) -> OracleBound:
    """Lower bounds of prefill work, with the engines' rules: whole blocks only, last token computed."""
    seen: set[int] = set()
    previous: dict[str, set[int]] = {}
    total = global_cost = shopper_cost = 0
    for request in trace:
        ids = token_ids(messages_text(request.messages))
        hashes = chained_block_hashes(ids, block_size)
        n = len(ids)
        total += n
        global_cost += n - _cached(hashes, seen, block_size, n)
        shopper_cost += n - _cached(hashes, previous.get(request.shopper_id, set()), block_size, n)
        seen.update(hashes)
        previous[request.shopper_id] = set(hashes)
    return OracleBound(total, global_cost, shopper_cost)


def _cached(hashes: Sequence[int], held: set[int], block_size: int, prompt_tokens: int) -> int:
    matched = 0
    for h in hashes:
        if h not in held:
            break
        matched += 1
    return max(0, min(matched * block_size, prompt_tokens - 1))


class _SyntheticShopper:
    """One shopper's taste (two categories, a budget) and its event generator."""

    def __init__(
        self, shopper_id: str, rng: random.Random, catalog: dict[str, list[Product]], categories: list[str]
    ) -> None:
        self.shopper_id = shopper_id
        self.rng = rng
        self.catalog = catalog
        self.categories = categories
        self.budget = rng.random()
        self.cart: list[Product] = []

    def _product(self) -> Product:
        category = self.categories[0] if self.rng.random() < 0.7 else self.categories[1]
        products = sorted(self.catalog[category], key=lambda p: p.price)
        pos = min(len(products) - 1, int(abs(self.rng.gauss(self.budget, 0.25)) * len(products)))
        return products[pos]

    def event(self, ts: float, *, allow_cart: bool = True) -> ShopperEvent:
        roll = self.rng.random()
        event_id = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        if roll < 0.12:
            product = self._product()
            query = f"{product.title.split()[0].lower()} {product.category.split(' > ')[-1].lower()}"
            return ShopperEvent(
                event_id=event_id, shopper_id=self.shopper_id, type="search", ts=ts, query=query
            )
        if allow_cart and self.cart and roll < 0.15:
            kind, product = "purchase", self.cart.pop()
        elif allow_cart and roll < 0.22:
            kind, product = "add_to_cart", self._product()
            self.cart.append(product)
        else:
            kind, product = ("click" if roll < 0.4 else "view"), self._product()
        return ShopperEvent.model_validate(
            {
                "event_id": event_id,
                "shopper_id": self.shopper_id,
                "type": kind,
                "ts": ts,
                "product": {
                    "product_id": product.product_id,
                    "title": product.title,
                    "brand": product.brand,
                    "category": product.category,
                    "price": product.price,
                    "snippet": product.snippet,
                },
            }
        )
