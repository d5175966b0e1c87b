"""The gateway's memory of each session's newest version (``gateway.supersede.SessionClaims``)."""

from __future__ import annotations

from gateway.flights import Flight
from gateway.supersede import SessionClaims


def test_a_version_far_ahead_is_forgotten_while_the_session_keeps_sending() -> None:
    # A version no real call reaches (a caller's mistake, or a forged one) refuses the session's real
    # versions until it is forgotten. Each refused arrival used to make the session recent in the LRU,
    # so a session whose caller kept sending was never forgotten: locked out for good.
    claims = SessionClaims(kept=2)
    claims.arrive("victim", (0, 9_999_999_999_999_999_999), Flight(keep_running=False))
    outcomes = []
    for version, other in enumerate(["a", "b", "c"], start=1):
        newer, _ = claims.arrive("victim", (0, version), Flight(keep_running=False))
        outcomes.append(newer is None)
        claims.arrive(other, (0, 1), Flight(keep_running=False))
    assert outcomes == [False, False, True], "refused until two other sessions pushed it out"


def test_a_late_version_is_refused_while_the_session_is_remembered() -> None:
    claims = SessionClaims(kept=2)
    claims.arrive("s", (0, 3), Flight(keep_running=False))
    assert claims.arrive("s", (0, 2), Flight(keep_running=False))[0] == (0, 3)
    assert claims.arrive("s", (0, 4), Flight(keep_running=False))[0] is None
