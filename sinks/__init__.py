"""Where results land: Redis (per-shopper signals for ad servers, read within seconds) and S3 (gzip
JSONL for analytics). Both are idempotent, so at-least-once delivery upstream becomes effectively-once
in storage."""
