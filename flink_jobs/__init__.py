"""Stream-engine shells around the engine-free parts: the embedded runner (a Kafka consumer group,
``local_runner``) and the PyFlink job (``near_realtime``). Both call the same session processor,
LLM client and sinks, so they produce the same results for the same events."""
