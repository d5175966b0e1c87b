"""Prompts in: a poll of ``PromptRequest`` records (``RunnerSettings.input`` 'prompts') turned into
one epoch of launched prompts.

The session stage ran elsewhere (the Flink job with ``prompts_topic``), so there is no session, timer
or re-key here: each record is one prompt, launched at once into ``PromptFlight``, where the
enrichment's gate decides what is sent (latest wins, priority, the answer ledger). The epoch is
committed, as the event path's is, only once every prompt it launched has its result stored. A record
that is not a prompt goes to the DLQ with the reason; a prompt seen twice (the session stage replayed
after a restart) is joined or answered from the ledger by the enrichment, never paid twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from confluent_kafka import Message
from pydantic import ValidationError

from prompt_assembly.events import describe_validation_error
from prompt_assembly.records import PromptRequest
from runner.epochs import Epoch

if TYPE_CHECKING:
    from runner.embedded import EmbeddedRunner


async def launch_prompts(runner: EmbeddedRunner, messages: list[Message]) -> None:
    """One poll of prompt records as one epoch: each valid prompt launched, each other record a dead
    letter. Freshness is counted from the prompt's ``due_ts`` (when it became due, event time)."""
    acct = runner.stats.accounting
    epoch = Epoch(lease=runner.assignment.lease)
    topic = runner.settings.topic
    launch = runner.prompts.launch
    for message in messages:
        partition = message.partition() or 0
        epoch.offsets[(message.topic() or topic, partition)] = (message.offset() or 0) + 1
        acct.consumed += 1
        value = message.value()
        try:
            if value is None:
                raise ValueError("empty message (null value)")
            prompt = PromptRequest.model_validate_json(value)
        except ValueError as error:  # a pydantic ValidationError is one
            why = describe_validation_error(error) if isinstance(error, ValidationError) else str(error)
            acct.dead_lettered += 1
            await runner.dead_letters.publish(message, f"not a prompt: {why}")
            continue
        acct.accepted += 1
        launch(prompt, epoch, prompt.due_ts or None)
    runner.dead_letters.producer.poll(0)
    runner.close_epoch(epoch, set())
