"""The embedded stack: real Kafka-protocol broker (Tansu), Redis, an S3 endpoint (moto) and LLM
replicas (the simulator or llama-server), started as local processes on free loopback ports when no
Docker engine is around. It reuses whatever is already reachable and stops exactly what it started."""
