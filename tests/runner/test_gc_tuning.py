"""runner.gc_tuning: the collector settings hold while any ingest loop runs and are restored after the
last one, nested or overlapping."""

from __future__ import annotations

import gc

from runner.gc_tuning import streaming_gc


def test_settings_hold_inside_and_are_restored_after_the_last_block() -> None:
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    first, second = streaming_gc(12_345), streaming_gc(12_345)
    first.__enter__()
    assert gc.get_threshold()[0] == 12_345 and gc.isenabled()
    assert gc.get_freeze_count() > frozen_before
    second.__enter__()
    first.__exit__(None, None, None)  # the first runner stops while the second still ingests
    assert gc.get_threshold()[0] == 12_345
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen_before
