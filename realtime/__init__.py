"""Real-time shopper-product matching: ``POST /v1/match`` ranks an ad server's candidates for one
shopper with reasons, from Redis signals and the latency pool, within a deadline (fallback when not).

Pure parts: ``models`` (the API contract), ``ranking`` (prompt, answer parsing, fallback),
``capacity`` (the replica-shifting controller). I/O: ``service`` (aiohttp), ``client`` (async and
sync clients for ad servers), ``shifter`` and ``pool`` (capacity shifting between real-time and
batch), ``cli`` (``shopper realtime``). See docs/realtime.md and docs/capacity.md.
"""
