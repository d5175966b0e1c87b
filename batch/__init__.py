"""Offline batch product understanding: S3 JSONL in, S3 JSONL parts + errors + Redis product signals out.

Pure parts (no I/O): ``records`` (input/output rows), ``documents`` (prompts, splitting), ``mapreduce``
(per-product call plan), ``aimd`` (adaptive concurrency), ``scheduler`` (priorities on a pool),
``manifest`` (checkpoint and shard bookkeeping). I/O at the edges: ``storage`` (S3), ``signals`` and
``coordination`` (Redis), ``pool`` and ``runner`` (LLM calls, the worker), ``cli`` (``shopper batch``).
See docs/batch.md.
"""
