"""Latest wins, per session, at the gateway: a request may supersede the same session's older one.

A caller sends the session in the routing-key header (``x-session-id``) and its version in
``x-session-version`` (``N``, or ``EPOCH.N`` as the pipeline's ``(session_epoch, seq)``; compared as
numbers, part by part). A newer version takes the session over: the older call is dropped from the
admission queue if it still waits there, or its upstream request is closed if it was sent
(``Flight.supersede``); a request older than the session's newest version is superseded on arrival.
The same version again (without a shared ``Idempotency-Key``, which joins instead) counts as newer:
the latest arrival wins. So does a version of another epoch: another session of the shopper, started
after its state was lost, whose epoch (the event time of its first event) may be smaller than the lost
one's when that event came late; ordered by epoch, every call of it was refused for as long as the
lost session's version was remembered. Only a later version of the same session supersedes.

This is ``pipeline.latest_wins`` for HTTP callers. It is kept apart because ``ShopperClaims`` is typed on
the pipeline's ``PromptRequest`` and its enrichment task; the rule is the same. The newest version of
each session is remembered after its call ended (an LRU of ``kept`` sessions), so a version that
arrives late, after a newer one was answered, is refused too.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from gateway.flights import Flight
from gateway.route import InvalidRequest

Version = tuple[int, int]


_VERSION = re.compile(r"(?:(\d{1,19})\.)?(\d{1,19})", re.ASCII)
"""``N`` or ``EPOCH.N`` in ASCII digits (``str.isdigit`` takes ``²``, which ``int`` refuses), at most 19
digits each (an epoch in milliseconds has 13; ``int`` refuses over 4,300)."""


def parse_version(text: str, header: str) -> Version:
    """``N`` or ``EPOCH.N``, non-negative integers; anything else is a 400."""
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        shown = text if len(text) <= 60 else text[:60] + "..."
        raise InvalidRequest(f"{header} must be N or EPOCH.N (non-negative integers), not {shown!r}", header)
    epoch, seq = match.groups()
    return (int(epoch) if epoch else 0, int(seq))


def version_text(version: Version) -> str:
    return f"{version[0]}.{version[1]}" if version[0] else str(version[1])


def _outruns(newest: Version, arriving: Version) -> bool:
    """Whether ``newest`` is a later version of ``arriving``'s own session (same epoch, higher seq)."""
    return newest[0] == arriving[0] and newest[1] > arriving[1]


@dataclass(slots=True)
class _Newest:
    version: Version
    flight: Flight | None


class SessionClaims:
    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._newest: OrderedDict[str, _Newest] = OrderedDict()

    def arrive(self, session: str, version: Version, flight: Flight) -> tuple[Version | None, Flight | None]:
        """(the newer version that supersedes this arrival, or None; the call this arrival displaces,
        or None)."""
        current = self._newest.get(session)
        if current is not None and _outruns(current.version, version):
            # Not made recent: a version no real call of the session reaches (a caller's mistake, or a
            # forged one: callers are not told apart) refused every later version, and each refusal
            # kept it remembered, so the session stayed locked out for as long as it kept sending.
            return current.version, None
        self._newest[session] = _Newest(version, flight)
        self._newest.move_to_end(session)
        while len(self._newest) > self.kept:
            self._newest.popitem(last=False)
        displaced = None if current is None or current.flight is flight else current.flight
        return None, displaced

    def displaceable(self, session: str, version: Version) -> Flight | None:
        """The call an arrival of ``version`` would displace (``arrive``), without arriving: None when
        there is none, or when the arrival is older than the session's newest version."""
        current = self._newest.get(session)
        if current is None or _outruns(current.version, version):
            return None
        return current.flight

    def leave(self, session: str, flight: Flight) -> None:
        """``flight`` ended: forget the call, keep the version."""
        current = self._newest.get(session)
        if current is not None and current.flight is flight:
            current.flight = None

    def __len__(self) -> int:
        return len(self._newest)
