"""The leak check counts real librdkafka clients: one made shows, one closed or dropped goes."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from devstack.stack import StackState
from tests.kafka_client_leaks import clients_left, running_clients


def test_a_client_held_is_left_running_and_one_closed_is_not(stack: StackState) -> None:
    before = running_clients()
    if before is None:
        pytest.fail("this suite runs on Linux, whose /proc names each thread")
    producer = Producer({"bootstrap.servers": stack.kafka_bootstrap})
    producer.poll(0)
    held = clients_left(before)
    producer.flush(5)
    producer.close()
    closed = clients_left(before)
    assert held == 1
    assert closed == 0


def test_a_client_dropped_in_a_cycle_goes_once_collected(stack: StackState) -> None:
    """What a failed run's error did to the runner's producers: held in a cycle, freed only by the
    collector, which the check runs before it counts."""
    before = running_clients()
    assert before is not None
    holder: dict[str, object] = {"producer": Producer({"bootstrap.servers": stack.kafka_bootstrap})}
    holder["self"] = holder  # a cycle: reference counting alone does not free it
    del holder
    assert clients_left(before) == 0
