"""Test helpers: producing records, and the offline oracle of what the pipeline must emit."""

from __future__ import annotations

from confluent_kafka import Producer

from prompt_assembly.events import MalformedEvent, parse_event
from prompt_assembly.processor import SessionConfig, SessionProcessor
from prompt_assembly.records import PromptRequest


def produce_records(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, bool]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log.connection.close": False})
    for key, value, _ in records:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def expected_prompts(
    records: list[tuple[bytes, bytes, bool]], config: SessionConfig | None = None
) -> dict[str, PromptRequest]:
    """Every prompt the pipeline must emit for ``records`` when pending triggers fire only from event
    time or at the final drain: the same pure processor, run in memory in per-shopper order."""
    processor = SessionProcessor(config)
    sessions = {}
    prompts: dict[str, PromptRequest] = {}
    for _, value, _ in records:
        try:
            event = parse_event(value)
        except MalformedEvent:
            continue
        session = sessions.setdefault(event.shopper_id, processor.new_session(event.shopper_id))
        for prompt in processor.apply(session, event).prompts:
            prompts[prompt.request_id] = prompt
    for session in sessions.values():
        for prompt in processor.flush(session):
            prompts[prompt.request_id] = prompt
    return prompts


def final_seq_by_shopper(prompts: dict[str, PromptRequest]) -> dict[str, int]:
    seqs: dict[str, int] = {}
    for prompt in prompts.values():
        seqs[prompt.shopper_id] = max(seqs.get(prompt.shopper_id, 0), prompt.seq)
    return seqs
