"""Engine-free domain logic of the pipeline: events, shopper sessions, trigger policy and prefix-stable
prompt assembly. Pure, synchronous and deterministic: no I/O, so every stream engine (the embedded
runner, the Flink job) and every test calls exactly the same code."""
