"""Keeps each test phase's report on the test item (``item.rep_setup``, ``rep_call``,
``rep_teardown``), so a fixture's teardown can tell a failed case from a passed one (pytest's
documented recipe) and print what only a failure needs."""

from __future__ import annotations

from collections.abc import Generator

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
