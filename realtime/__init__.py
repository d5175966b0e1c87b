"""Real-time shopper-product matching: ``POST /v1/match`` ranks an ad server's candidates for one
shopper with reasons, from Redis signals and the latency pool, within a deadline (fallback when not).

Pure parts: ``models`` (the API contract), ``ranking`` (prompt, answer parsing, fallback), ``auth`` and
``rate_limit`` (API keys, token buckets), ``openapi`` (the spec). I/O: ``service`` (``create_app``: wires
the parts), ``matching`` (one request within its deadline), ``signals`` (the Redis read), ``handlers``,
``guards`` and ``http_errors`` (HTTP), ``metrics``, ``load_meter``, ``loop_lag``, ``llm_pool``,
``shifting`` (capacity shifting with batch, engine-free parts in ``capacity``), ``client`` (async and
sync clients for ad servers), ``cli`` (``shopper realtime``). See docs/realtime.md, docs/security.md.
"""
