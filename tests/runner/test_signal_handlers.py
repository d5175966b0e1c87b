"""A runner run inside a process gives the process its signal handlers back. While it runs, SIGTERM
and SIGINT drain it; after, they are the process's own again. asyncio's loop close set them to the
defaults, so the test session (``tests/cancellation.py``) or an application embedding the runner lost
its SIGTERM handling after the first run."""

from __future__ import annotations

import asyncio
import signal
import time
from types import FrameType

from runner.embedded import EmbeddedRunner
from tests.conftest import Isolated
from tests.helpers import produce_records
from tests.runner.kit import cart_add


def test_a_run_gives_the_process_its_own_signal_handlers_back(isolated: Isolated) -> None:
    def own(signum: int, frame: FrameType | None) -> None:
        raise AssertionError("not called here")

    produce_records(isolated.stack.kafka_bootstrap, isolated.topic, [cart_add("s-1", time.time())])
    previous = signal.signal(signal.SIGTERM, own)
    interrupt = signal.getsignal(signal.SIGINT)
    try:
        stats = asyncio.run(EmbeddedRunner(isolated.runner(), log=lambda _: None).run())
        assert stats.accounting.insights == 1
        assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGINT) is interrupt
    finally:
        signal.signal(signal.SIGTERM, previous)
