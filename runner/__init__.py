"""The embedded runner: the near-real-time pipeline on a Kafka consumer group, one process per core."""
