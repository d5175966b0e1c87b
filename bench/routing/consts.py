"""Paths and names every part of the routing benchmark shares."""

from __future__ import annotations

from bench.common import REPO, results_dir

__all__ = ["BLOCK", "POLICIES", "REPO", "RESULTS"]

RESULTS = results_dir()


POLICIES = ("round_robin", "least_outstanding", "session_affinity", "prefix_aware")


BLOCK = 32
