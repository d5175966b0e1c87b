"""A failed attempt takes back only the blocks no sibling still counts on (``prefix_aware``).

Two prompts of one shopper, the newer extending the older, go to one replica; the older attempt fails
after the newer was routed. Its failure used to take back every block its routing recorded, the prefix
the newer one shares included, which that replica will hold once the newer one is prefilled: the
router believed the replica lacked the shopper's prefix, and the shopper's next prompt went elsewhere
and was prefilled from scratch. The attempts below are driven as ``llm_client.exchange`` drives them
(choose, first token, failure or answer, end of the attempt), on real ``Endpoint`` objects.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_client.endpoints import Endpoint
from llm_client.routing.base import RouteOutcome, RouteRequest
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from tests.llm_client.test_routing_prefix_aware import FakeClock, endpoints, shopper_prompt

FAILED = RouteOutcome(ok=False)
"""A 503 or a timeout: not a failed connection, which ejects the replica and forgets its index."""


class Attempt:
    """One attempt as ``Exchange.completion`` runs it: the load it puts on the replica and what it
    tells the policy, in the client's order."""

    def __init__(self, policy: PrefixAwarePolicy, request: RouteRequest, eps: list[Endpoint]) -> None:
        self.policy, self.request = policy, request
        self.endpoint = endpoint = policy.choose(request, eps)
        self.prefill = policy.estimate_uncached_tokens(request, endpoint)
        endpoint.outstanding += 1
        endpoint.outstanding_prefill_tokens += self.prefill
        endpoint.outstanding_decode_tokens += request.max_tokens

    def first_token(self) -> None:
        self.endpoint.outstanding_prefill_tokens -= self.prefill
        self.prefill = 0
        self.policy.prefill_done(self.request, self.endpoint)

    def fail(self) -> None:
        self.policy.observe(self.request, self.endpoint, FAILED)  # Fleet.failed, in the except
        self._over(computed=False)

    def answer(self) -> None:
        self.first_token()
        self._over(computed=True)
        request, endpoint = self.request, self.endpoint
        cached = request.prompt_tokens - self.policy.estimate_uncached_tokens(request, endpoint)
        self.policy.observe(request, endpoint, RouteOutcome(True, request.prompt_tokens, cached))

    def cancel(self) -> None:
        """The caller's deadline: nothing is learned, the attempt just ends."""
        self._over(computed=False)

    def _over(self, *, computed: bool) -> None:
        """The ``finally`` of an attempt."""
        self.endpoint.outstanding -= 1
        self.endpoint.outstanding_prefill_tokens -= self.prefill
        self.prefill = 0
        if not computed:
            self.policy.prefill_abandoned(self.request, self.endpoint)
        self.endpoint.outstanding_decode_tokens -= self.request.max_tokens
        self.policy.attempt_over(self.request, self.endpoint)


Siblings = tuple[PrefixAwarePolicy, FakeClock, Endpoint, Endpoint, Attempt, Attempt]


def siblings(older_first_token: bool) -> Siblings:
    """A shopper's first prompt and its extension, both routed to ``home`` (``far`` runs another
    shopper's 2,000-token prefill meanwhile), the older one's first token reported or not."""
    clock = FakeClock()
    policy = PrefixAwarePolicy(clock=clock)
    home, far = endpoints(2)
    far.outstanding_prefill_tokens = 2000
    older = Attempt(policy, shopper_prompt("zoe", 60), [home, far])
    assert older.endpoint is home
    if older_first_token:
        older.first_token()
    clock.now += 0.2
    newer = Attempt(policy, shopper_prompt("zoe", 64), [home, far])
    assert newer.endpoint is home  # it follows the older one's blocks
    assert policy.estimate_uncached_tokens(newer.request, home) < 0.2 * newer.request.prompt_tokens
    return policy, clock, home, far, older, newer


@pytest.mark.parametrize("older_first_token", [False, True], ids=["before-first-token", "mid-answer"])
def test_the_next_prompt_follows_the_newer_sibling_after_the_older_failed(older_first_token: bool) -> None:
    policy, clock, home, far, older, newer = siblings(older_first_token)
    older.fail()  # a 503, or a stalled stream, while the newer one waits in home's queue
    far.outstanding_prefill_tokens = 0  # the other shopper's prefill there is done
    clock.now += 0.2
    following = shopper_prompt("zoe", 66)
    # home will hold the whole shared prefix once the newer prompt is prefilled there. Before, its
    # index lacked the prefix and home carried the newer prompt's load, so the next prompt went to far,
    # cold (a full prefill of 3.8k tokens).
    assert Attempt(policy, following, [home, far]).endpoint is home
    assert policy.estimate_uncached_tokens(following, home) < 0.2 * following.prompt_tokens
    assert policy.cached_tokens(newer.request, home) > 0.9 * newer.request.prompt_tokens


def test_the_prefix_stays_when_the_newer_sibling_answered_before_the_older_one_failed() -> None:
    policy, clock, home, far, older, newer = siblings(older_first_token=True)
    newer.answer()  # home computed the whole shared prefix and said so
    older.fail()  # then the older one's long answer stalls
    far.outstanding_prefill_tokens = 0
    home.outstanding_prefill_tokens = 500  # another shopper's prompt queued there
    clock.now += 0.2
    following = shopper_prompt("zoe", 66)
    assert policy.cached_tokens(following, home) > 0.9 * newer.request.prompt_tokens
    assert Attempt(policy, following, [home, far]).endpoint is home


def test_a_prefix_the_newer_sibling_computed_stays_when_it_fails_after_its_first_token() -> None:
    """The older prompt fails while the newer waits; the newer is then prefilled (its first token: home
    holds the prefix) and later fails too (a stalled stream). The prefix it computed stays believed."""
    policy, clock, home, far, older, newer = siblings(older_first_token=False)
    older.fail()
    newer.first_token()
    newer.fail()
    far.outstanding_prefill_tokens = 0
    home.outstanding_prefill_tokens = 500  # another shopper's prompt queued there
    clock.now += 0.2
    following = shopper_prompt("zoe", 66)
    assert policy.cached_tokens(older.request, home) > 0.9 * older.request.prompt_tokens
    assert Attempt(policy, following, [home, far]).endpoint is home


def test_an_orphaned_prefix_goes_when_its_last_sibling_is_cancelled_before_computing_it() -> None:
    """The older prompt fails, the newer one (the last to count on the shared prefix) is cancelled by
    its deadline before its first token: nobody computed the prefix, so it is not believed."""
    policy, _, home, _, older, newer = siblings(older_first_token=False)
    older.fail()
    newer.cancel()
    assert policy.cached_tokens(older.request, home) == 0
    assert not policy._credits.get(home.name)


@pytest.mark.parametrize("older_fails_first", [True, False], ids=["older-first", "newer-first"])
def test_when_both_siblings_fail_nothing_of_theirs_is_believed(older_fails_first: bool) -> None:
    """Nobody computed the prefix: as for one failed request, what routing recorded goes."""
    policy, _, home, _, older, newer = siblings(older_first_token=False)
    for attempt in (older, newer) if older_fails_first else (newer, older):
        attempt.fail()
    assert policy.cached_tokens(newer.request, home) == 0
    assert policy.cached_tokens(older.request, home) == 0
    assert not policy._credits.get(home.name)  # nothing left counted for attempts that are over


def test_a_lone_failed_attempt_takes_back_its_blocks_in_either_order_of_the_clients_calls() -> None:
    """``Exchange`` reports the failure before the end of the attempt; the proxy's path (an error event
    in a stream read to its end) ends the attempt first. Either way a lone failure leaves nothing."""
    for observe_first in (True, False):
        policy, (home, far) = PrefixAwarePolicy(), endpoints(2)
        request = shopper_prompt("yann", 60)
        chosen = policy.choose(request, [home, far])
        policy.prefill_done(request, chosen)  # even after its first token, as before
        if not observe_first:
            policy.attempt_over(request, chosen)
        policy.observe(request, chosen, FAILED)
        policy.attempt_over(request, chosen)
        assert policy.cached_tokens(shopper_prompt("yann", 60), chosen) == 0
        assert not policy._credits.get(chosen.name)


@settings(max_examples=60, deadline=None)
@given(
    ends=st.permutations(range(4)),
    outcomes=st.lists(st.sampled_from(["fail", "answer", "cancel"]), min_size=4, max_size=4),
)
def test_siblings_ending_in_any_order_leave_what_was_answered_and_no_credit(
    ends: list[int], outcomes: list[str]
) -> None:
    """Four prompts of one shopper in flight on one replica, ending in any order, each failed, answered
    or cancelled: every answered prompt stays held, nothing stays of a set of failures alone, and no
    credit outlives its attempt."""
    policy, home = PrefixAwarePolicy(), endpoints(1)[0]
    attempts = [Attempt(policy, shopper_prompt("xena", 60 + 2 * i), [home]) for i in range(4)]
    for i in ends:
        {"fail": attempts[i].fail, "answer": attempts[i].answer, "cancel": attempts[i].cancel}[outcomes[i]]()
    for attempt, outcome in zip(attempts, outcomes, strict=True):
        if outcome == "answer":
            hashes = policy.block_hashes(attempt.request)
            assert policy.index(home).longest_prefix(hashes) == len(hashes)
    if set(outcomes) == {"fail"}:
        assert policy.cached_tokens(attempts[0].request, home) == 0
    assert not policy._credits
