"""Paths and names every part of the routing benchmark shares."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


RESULTS = REPO / "bench" / "results"


POLICIES = ("round_robin", "least_outstanding", "session_affinity", "prefix_aware")


BLOCK = 32
