"""The engine-free core of the near-real-time pipeline: what both engines (the embedded runner and the
Flink job) call for everything but delivery — the dead-letter record, the enrichment step, the sink
commit step with its retry policy, topic names and accounting."""
