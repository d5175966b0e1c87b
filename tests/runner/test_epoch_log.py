"""The epoch log hands the durable point only its *completed prefix*: the epochs from the oldest up to
the first one whose prompts are still running. A complete epoch behind an incomplete one waits: taken
first, its offsets (further than the incomplete epoch's) would be committed past records whose results
are not stored yet, and a crash then lost them."""

from __future__ import annotations

from runner.epochs import Epoch, EpochLog


def test_a_complete_epoch_behind_an_incomplete_one_is_not_taken() -> None:
    log = EpochLog()
    running = Epoch(offsets={("events", 0): 10}, pending=1)  # a prompt still in flight
    done = Epoch(offsets={("events", 0): 20})
    log.append(running)
    log.append(done)

    assert log.take_completed_prefix() == []
    assert len(log) == 2, "both epochs stay in the log"

    running.pending = 0  # its result stored: now both go, in the order they were opened
    taken = log.take_completed_prefix()
    assert len(taken) == 2 and taken[0] is running and taken[1] is done
    assert len(log) == 0
