"""The Redis key schema: every key this project reads or writes is named here, nowhere else.

One prefix (``SinkSettings.redis_key_prefix``, ``su:`` in production) namespaces a deployment; tests and
local runs use their own. Ad servers read ``signals``; the rest is the pipeline's own state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str

    # ---- what ad servers and the real-time path read ----
    def signals(self, shopper_id: str) -> str:
        """Hash: the newest understanding of a shopper (written only when ``seq`` is newer)."""
        return f"{self.prefix}signals:{shopper_id}"

    def signals_pattern(self) -> str:
        return f"{self.prefix}signals:*"

    def shopper_of_signals(self, key: str) -> str:
        return key.removeprefix(f"{self.prefix}signals:")

    def signal_errors(self, shopper_id: str) -> str:
        """Hash: error records of a shopper, by ``request_id`` (kept apart from the signals); expires
        with the same TTL as ``signals`` (``SinkSettings.signal_ttl_s``) and holds at most
        ``SinkSettings.signal_errors_max`` of them, those of the newest versions."""
        return f"{self.prefix}signal_errors:{shopper_id}"

    def product(self, product_id: str) -> str:
        """Hash: batch product understanding (segments, occasions, style)."""
        return f"{self.prefix}product:{product_id}"

    # ---- the answer ledger (pipeline.answer_ledger): never pay twice for one prompt ----
    def answer(self, request_id: str) -> str:
        """String: the JSON of the answer a prompt got, by ``request_id`` (``shopper:epoch:seq``),
        written as it arrives; expires after ``SinkSettings.answer_ttl_s``."""
        return f"{self.prefix}answer:{request_id}"

    # ---- the embedded runner's session state ----
    def session_header(self, shopper_id: str) -> str:
        return f"{self.prefix}session:{shopper_id}:h"

    def session_log(self, shopper_id: str) -> str:
        return f"{self.prefix}session:{shopper_id}:log"

    def timers(self, partition: int) -> str:
        """Sorted set: shopper -> wall deadline of its pending trigger, per partition."""
        return f"{self.prefix}timers:{partition}"

    def session_owner(self, partition: int) -> str:
        """String: the fencing token of the partition's newest owner (``runner.ownership``); no TTL,
        one key per partition."""
        return f"{self.prefix}session_owner:{partition}"

    def session_save(self, save_id: str) -> str:
        """String: set by the session save ``save_id`` as it applies, so that its retry applies nothing
        (``runner.session_store.SAVE_MARK_TTL_S``)."""
        return f"{self.prefix}session_save:{save_id}"

    # ---- batch jobs and capacity shifting ----
    def batch_lease(self, job_id: str) -> str:
        return f"{self.prefix}batch:lease:{job_id}"

    def batch_progress(self, job_id: str) -> str:
        return f"{self.prefix}batch:progress:{job_id}"

    def pool(self, name: str) -> str:
        """The shared replica pool's current split (capacity shifting), under the shifter's lease."""
        return f"{self.prefix}pool:{name}"

    def pool_held(self, name: str) -> str:
        """How many replicas real time held in the pool's last split: outlives the split's lease, so that
        a real-time service restarted after it lapsed resumes from that count, not from its floor."""
        return f"{self.prefix}pool:{name}:held"
