"""The P/D-aware policy's decisions, pure: which decode server, and the conditional rule (prefill
locally or on a context server) at its boundaries."""

from __future__ import annotations

import pytest

from llm_client.config import ClientConfig
from llm_client.endpoints import Endpoint
from llm_client.routing import make_policy
from llm_client.routing.base import RouteRequest
from llm_client.routing.pd_aware import PdAwarePolicy, PdAwareSettings
from prompt_assembly.tokens import count_tokens

BLOCK = 32


def route(text: str, key: str = "s1") -> RouteRequest:
    return RouteRequest(key, text, count_tokens(text), 200)


def words(n: int, seed: str = "w") -> str:
    """About ``n`` tokens of text (one token a word)."""
    return "".join(f" {seed}{i % 97}x" for i in range(n // 2))


def servers(prefix: str, n: int) -> list[Endpoint]:
    return [Endpoint(f"http://{prefix}{i}", f"{prefix}{i}") for i in range(n)]


def warm(policy: PdAwarePolicy, decode: Endpoint, text: str) -> None:
    """``decode`` believed to hold ``text`` (as after serving it)."""
    request = route(text)
    assert policy.choose(request, [decode]) is decode
    policy.attempt_over(request, decode)


@pytest.mark.parametrize("extra", [0, 1])
def test_local_prefill_up_to_max_local_prefill_tokens_and_remote_one_token_past(extra: int) -> None:
    policy = PdAwarePolicy(PdAwareSettings(max_local_prefill_tokens=256))
    (decode,), contexts = servers("d", 1), servers("c", 2)
    history = words(2048)
    warm(policy, decode, history)
    request = route(history + words(600, "n"))
    cached = policy.decode.cached_tokens(request, decode)
    assert cached >= 2048 - BLOCK
    # move the boundary to exactly the uncached part (+ extra), so the rule is tested at its edge
    uncached = request.prompt_tokens - cached
    policy = PdAwarePolicy(PdAwareSettings(max_local_prefill_tokens=uncached - extra))
    warm(policy, decode, history)
    plan = policy.context_for(request, decode, contexts)
    if extra == 0:
        assert plan is None and policy.stats.local_small == 1
    else:
        assert plan is not None and plan[0] in contexts and policy.stats.remote == 1
        step = plan[1]
        assert step.max_tokens == 1 and step.key == request.key and step.memo is not request.memo


def test_a_cold_prompt_goes_to_a_context_server() -> None:
    policy = PdAwarePolicy()
    (decode,), contexts = servers("d", 1), servers("c", 3)
    plan = policy.context_for(route(words(3000)), decode, contexts)
    assert plan is not None and plan[0] in contexts


def test_min_remote_share_keeps_a_mostly_cached_prompt_local() -> None:
    policy = PdAwarePolicy(PdAwareSettings(max_local_prefill_tokens=0, min_remote_share=0.7))
    (decode,), contexts = servers("d", 1), servers("c", 1)
    history = words(3000)
    warm(policy, decode, history)
    assert policy.context_for(route(history + words(900, "n")), decode, contexts) is None  # ~25% new
    assert policy.stats.local_share == 1
    assert policy.context_for(route(words(3000, "other")), decode, contexts) is not None  # all new


def test_a_busy_context_pool_means_a_local_prefill_when_asked_for() -> None:
    policy = PdAwarePolicy(PdAwareSettings(context_busy_tokens=1000, local_when_busy=True))
    (decode,), contexts = servers("d", 1), servers("c", 2)
    for c in contexts:
        c.outstanding_prefill_tokens = 1000
    assert policy.context_for(route(words(3000)), decode, contexts) is None
    assert policy.stats.local_busy == 1
    contexts[1].outstanding_prefill_tokens = 999
    plan = policy.context_for(route(words(3000)), decode, contexts)
    assert plan is not None and plan[0] is contexts[1]


def test_no_routable_context_server_means_a_local_prefill() -> None:
    policy = PdAwarePolicy()
    (decode,) = servers("d", 1)
    assert policy.context_for(route(words(3000)), decode, []) is None
    assert policy.stats.local_no_context == 1


def test_without_generation_block_reuse_nothing_is_credited_to_the_decode_server() -> None:
    policy = PdAwarePolicy(PdAwareSettings(generation_block_reuse=False))
    (decode,), contexts = servers("d", 1), servers("c", 1)
    history = words(2048)
    warm(policy, decode, history)
    request = route(history + words(100, "n"))
    assert policy.uncached_on_decode(request, decode) == request.prompt_tokens
    assert policy.context_for(request, decode, contexts) is not None


def test_a_shopper_stays_on_the_decode_server_that_holds_its_prefix() -> None:
    policy = PdAwarePolicy()
    decodes = servers("d", 4)
    history = words(2048)
    first = policy.choose(route(history), decodes)
    policy.attempt_over(route(history), first)
    for i in range(5):
        request = route(history + words(100 * (i + 1), "n"))
        assert policy.choose(request, decodes) is first
        policy.attempt_over(request, first)


def test_the_policy_is_chosen_by_name_with_typed_settings() -> None:
    policy = make_policy("pd_aware", max_local_prefill_tokens=128)
    assert isinstance(policy, PdAwarePolicy) and policy.settings.max_local_prefill_tokens == 128
    with pytest.raises(ValueError):
        make_policy("pd_aware", max_local_prefill_tokens=-1)


def test_context_servers_need_the_pd_aware_policy() -> None:
    with pytest.raises(ValueError, match="pd_aware"):
        ClientConfig(endpoints=["http://d:1"], context_endpoints=["http://c:1"], policy="prefix_aware")
    config = ClientConfig(endpoints=["http://d:1"], context_endpoints=["http://c:1"], policy="pd_aware")
    assert config.routing().policy == "pd_aware"


def test_local_only_when_idle_keeps_a_busy_decode_servers_batch_free_of_prefills() -> None:
    policy = PdAwarePolicy()  # the default
    (decode,), contexts = servers("d", 1), servers("c", 1)
    history = words(2048)
    warm(policy, decode, history)
    request = route(history + words(100, "n"))
    assert policy.context_for(request, decode, contexts) is None  # idle: local
    decode.outstanding = 1
    assert policy.context_for(request, decode, contexts) is not None  # decoding: remote


def test_local_when_busy_off_queues_at_the_context_servers() -> None:
    policy = PdAwarePolicy(PdAwareSettings(context_busy_tokens=1000))  # off by default
    (decode,), contexts = servers("d", 1), servers("c", 1)
    contexts[0].outstanding_prefill_tokens = 5000
    assert policy.context_for(route(words(3000)), decode, contexts) is not None
