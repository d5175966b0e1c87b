"""Shopper sessions in Redis, for the embedded runner (the Flink job keeps them in keyed state).

Layout per shopper: ``{p}session:{id}:h`` (JSON header, the pending trigger's reason and event-time
due time among it) and ``{p}session:{id}:log`` (a list of entries, append-only except after a trim,
when it is rewritten). Pending triggers are mirrored in ``{p}timers:{partition}`` (sorted set:
shopper -> wall deadline) so that a restarted runner re-arms them. Deltas are applied in epoch order,
only after the results of those epochs are durable, and only by the partition's newest owner:
``{p}session_owner:{partition}`` holds its fencing token (``runner.ownership``), and a save that names
another one writes nothing.

Round trips (what the ingest profile in ``docs/benchmarks.md`` asked for): a save is one Lua script
call, atomic like the MULTI/EXEC it replaced, with each shopper's deltas of the whole save merged
first (one append or one rewrite, one header, one timer update per shopper, however many epochs
touched it), and each shopper's new entries sent as one argument (``ENTRY_SEPARATOR``); a load is
one MGET of the headers, then one pipeline of LRANGEs for the shoppers that exist (none, for new
shoppers).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import orjson
import redis.asyncio as aioredis

from prompt_assembly.events import ShopperEvent
from prompt_assembly.session import RestoreDamage, SessionChanges, SessionEntry, ShopperSession
from sinks.keys import RedisKeys


@dataclass(frozen=True, slots=True)
class SessionDelta:
    shopper_id: str
    partition: int
    changes: SessionChanges
    wall_deadline: float | None
    """The wall deadline of the trigger pending after this epoch (None: none pending; with a pending
    header, None removes its stored timer, so it has no default: every caller says which). Taken when the
    epoch closes, with its header, so a save stores the timer of the header it stores: taken from the
    live session at save time instead, a pause a timer fired in a later epoch (not yet durable) lost
    its stored timer while the saved header still said pending, and a crash then left it unfired."""


@dataclass(slots=True)
class _MergedDelta:
    """One shopper's deltas of a save, applied in order: a rewrite replaces everything before it."""

    partition: int
    header: dict[str, object]
    wall_deadline: float | None = None
    rewrite: bool = False
    entries: list[SessionEntry] = field(default_factory=list)

    def add(self, delta: SessionDelta) -> None:
        changes = delta.changes
        if changes.rewrite is not None:
            self.rewrite = True
            self.entries = list(changes.rewrite)
        else:
            self.entries.extend(changes.appended)
        self.header = changes.header
        self.wall_deadline = delta.wall_deadline
        self.partition = delta.partition


def merge_deltas(deltas: Iterable[SessionDelta]) -> dict[str, _MergedDelta]:
    """Per shopper, the net effect of ``deltas`` (in order), in first-touched order."""
    merged: dict[str, _MergedDelta] = {}
    for delta in deltas:
        net = merged.get(delta.shopper_id)
        if net is None:
            net = merged[delta.shopper_id] = _MergedDelta(delta.partition, delta.changes.header)
        net.add(delta)
    return merged


# KEYS: per shopper its header and log key, then the timer keys, then the owner keys of the partitions
# written, then the save's mark. ARGV: ttl, shopper count, owner count, then per owner key the token
# this save holds (its partition's number follows it), then per shopper: 'r' (rewrite) or 'a' (append),
# header, timer key index, 'z' (arm) or 'x' (clear), shopper id, wall deadline, and its new entries as
# one argument, joined by NUL (ENTRY_SEPARATOR), then the mark's TTL. Nothing is written unless every
# token is still its partition's; else the partitions whose token is not come back as a list. A token
# key Redis no longer holds (restarted without persistence, a failover that lost it) is set back to the
# saver's: no newer owner took the partition since (a take sets it), and a save fenced for ever would
# stop the member's commits. RPUSH in chunks: Lua's unpack has a bounded stack. A save whose mark is
# set was applied already (its reply lost to the client's timeout, then retried): nothing is written
# again, since its appends are not idempotent.
_SAVE_LUA = """
local mark = KEYS[#KEYS]
if redis.call('EXISTS', mark) == 1 then return tonumber(ARGV[2]) end
local ttl = ARGV[1]
local shoppers = tonumber(ARGV[2])
local owners = tonumber(ARGV[3])
local first_owner = #KEYS - 1 - owners
local fenced, forgotten = {}, {}
for j = 1, owners do
  local held = redis.call('GET', KEYS[first_owner + j])
  if held == false then
    forgotten[#forgotten + 1] = j
  elseif held ~= ARGV[2 + 2 * j] then
    fenced[#fenced + 1] = tonumber(ARGV[3 + 2 * j])
  end
end
if #fenced > 0 then return fenced end
for _, j in ipairs(forgotten) do redis.call('SET', KEYS[first_owner + j], ARGV[2 + 2 * j]) end
local a = 4 + 2 * owners
for i = 1, shoppers do
  local header_key, log_key = KEYS[2 * i - 1], KEYS[2 * i]
  local timers = KEYS[tonumber(ARGV[a + 2])]
  if ARGV[a] == 'r' then redis.call('DEL', log_key) end
  local batch, n = {}, 0
  for entry in string.gmatch(ARGV[a + 6], '[^%z]+') do
    n = n + 1
    batch[n] = entry
    if n == 1000 then
      redis.call('RPUSH', log_key, unpack(batch, 1, n))
      n = 0
    end
  end
  if n > 0 then redis.call('RPUSH', log_key, unpack(batch, 1, n)) end
  redis.call('SET', header_key, ARGV[a + 1], 'EX', ttl)
  redis.call('EXPIRE', log_key, ttl)
  if ARGV[a + 3] == 'z' then
    redis.call('ZADD', timers, ARGV[a + 5], ARGV[a + 4])
  else
    redis.call('ZREM', timers, ARGV[a + 4])
  end
  a = a + 7
end
redis.call('SET', mark, '1', 'EX', ARGV[#ARGV])
return shoppers
"""

SAVE_MARK_TTL_S = 3600
"""How long a save's mark stays (``RedisKeys.session_save``): past any retry of it (``sink_retry``
gives up after 120 s by default). Without the mark, a save whose reply came after the client's socket
timeout had applied, and its retry appended the same entries again: a session listed events twice."""

ENTRY_SEPARATOR = b"\x00"
"""Between a shopper's entries in one script argument. A stored entry is JSON (``SessionEntry.to_json``:
orjson's output, or bytes read back through msgspec's strict decoder), and JSON has no raw NUL byte,
in a string or between tokens, so the split is exact. One argument per shopper instead of one per
entry: redis-py packs every argument in Python, and that packing was most of a save's CPU (the ingest
profile in ``docs/benchmarks.md``)."""


class _StoredProduct(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    product_id: str
    title: str
    brand: str = ""
    category: str = ""
    snippet: str = ""
    price: float


class _StoredEvent(msgspec.Struct, omit_defaults=True, gc=False):
    event_id: str
    shopper_id: str
    type: str
    ts: float
    product: _StoredProduct | None = None
    query: str = ""
    quantity: int = 1


_encode_stored = msgspec.json.Encoder().encode


def stored_json(event: ShopperEvent) -> bytes:
    """``prompt_assembly.session.stored_event(event)``, byte for byte, in half its time: the same
    fields in the same order, defaults left out (``omit_defaults``), encoded by msgspec, whose strings
    and floats are orjson's within the schema's ranges (a float is written alike below 1e16; ``ts`` is
    under 1e10, a price at most 1e6). ``tests/runner/test_session_store_encoding.py`` holds the two
    equal on the synthetic stream and on fuzzed events."""
    product = event.product
    return _encode_stored(
        _StoredEvent(
            event.event_id,
            event.shopper_id,
            event.type,
            event.ts,
            None
            if product is None
            else _StoredProduct(
                product_id=product.product_id,
                title=product.title,
                brand=product.brand,
                category=product.category,
                snippet=product.snippet,
                price=product.price,
            ),
            event.query,
            event.quantity,
        )
    )


def cache_stored(entry: SessionEntry) -> None:
    """Make ``entry``'s stored event now (``stored_json``), while its event is fresh in the CPU's
    caches: ingest calls this as it adds an event. Made at the save instead, shopper by shopper, the
    same encoding read events scattered over the heap and cost three times as much
    (``docs/benchmarks.md``, runner ingest)."""
    if entry.stored is None:
        try:  # noqa: SIM105 (a try costs nothing here; contextlib.suppress is a call per entry)
            entry.stored = stored_json(entry.event)
        except (msgspec.EncodeError, UnicodeEncodeError):  # to_json decides (and words) what fails
            pass


def joined_entries(entries: list[SessionEntry]) -> bytes:
    """``entries`` as one script argument (see ``ENTRY_SEPARATOR``), each exactly as
    ``SessionEntry.to_json`` writes it (its stored event made by ``stored_json`` when not cached)."""
    for entry in entries:
        if entry.stored is None:
            cache_stored(entry)
    blob = ENTRY_SEPARATOR.join([entry.to_json() for entry in entries])
    if blob.count(ENTRY_SEPARATOR) != max(0, len(entries) - 1):  # one memchr pass; JSON never holds one
        raise ValueError("a stored session entry holds a NUL byte, which JSON cannot")
    return blob


class SessionsFenced(Exception):
    """A save refused, nothing of it written: another member took these partitions since this one
    took its tokens (a hand-over), so their sessions are the other member's to write."""

    def __init__(self, partitions: list[int], why: str) -> None:
        super().__init__(f"session save refused for partitions {partitions}: {why}")
        self.partitions = partitions


class RedisSessionStore:
    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int = 7 * 24 * 3600) -> None:
        self.redis = redis
        self.keys = RedisKeys(prefix)
        self.ttl_s = ttl_s
        self._save_script = redis.register_script(_SAVE_LUA)
        self.damaged: list[tuple[str, RestoreDamage]] = []
        """Sessions loaded with what could not be read of them (``ShopperSession.salvage``), for the
        runner to count and log (``take_damaged``)."""

    def _h(self, shopper_id: str) -> str:
        return self.keys.session_header(shopper_id)

    def _log(self, shopper_id: str) -> str:
        return self.keys.session_log(shopper_id)

    def _timers(self, partition: int) -> str:
        return self.keys.timers(partition)

    async def load_many(self, shopper_ids: Sequence[str]) -> dict[str, ShopperSession]:
        """Sessions that exist in Redis (missing ids are simply absent from the result)."""
        if not shopper_ids:
            return {}
        headers = await self.redis.mget([self._h(shopper_id) for shopper_id in shopper_ids])
        found = [(sid, h) for sid, h in zip(shopper_ids, headers, strict=True) if h is not None]
        if not found:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for shopper_id, _ in found:
            pipe.lrange(self._log(shopper_id), 0, -1)
        logs = await pipe.execute()
        sessions: dict[str, ShopperSession] = {}
        for (shopper_id, header), entries in zip(found, logs, strict=True):
            session, damage = ShopperSession.salvage(shopper_id, header, entries)
            if damage is not None:
                self.damaged.append((shopper_id, damage))
            sessions[shopper_id] = session
        return sessions

    def take_damaged(self) -> list[tuple[str, RestoreDamage]]:
        """The sessions loaded with damage since the last call (and forgets them)."""
        damaged, self.damaged = self.damaged, []
        return damaged

    async def take_ownership(self, partition: int) -> str:
        """A fencing token for ``partition``'s sessions, set as the partition's over any taken before
        it: saves made with those are refused from now on (``runner.ownership``). Random, not a
        counter: a counter Redis lost (a restart without persistence) would hand a new owner a token
        an old one still holds."""
        token = uuid.uuid4().hex
        await self.redis.set(self.keys.session_owner(partition), token)
        return token

    async def save(
        self, deltas: Iterable[SessionDelta], owner_tokens: Mapping[int, str], save_id: str | None = None
    ) -> int:
        """Apply deltas in order (one script call, one round trip, all or nothing), each shopper's
        timer following its last delta (``SessionDelta.wall_deadline``), if ``owner_tokens`` (partition
        -> token, ``take_ownership``) still holds the newest token of every partition written; else
        ``SessionsFenced`` and nothing written. Returns the number of shoppers written. ``save_id``: the
        same for every try of one save, so a try after one that applied but whose reply was lost
        writes nothing (None: a fresh one, for a caller that does not retry)."""
        merged = merge_deltas(deltas)
        if not merged:
            return 0
        written = sorted({net.partition for net in merged.values()})
        unowned = [partition for partition in written if partition not in owner_tokens]
        if unowned:
            raise SessionsFenced(unowned, "no token taken")
        keys = [key for sid in merged for key in (self._h(sid), self._log(sid))]
        timer_keys: dict[int, int] = {}  # partition -> its 1-based index in KEYS, after the sessions
        args: list[bytes | str | int | float] = [self.ttl_s, len(merged), len(written)]
        for partition in written:
            args += [owner_tokens[partition], partition]
        for sid, net in merged.items():
            timer_at = timer_keys.get(net.partition)
            if timer_at is None:
                timer_at = timer_keys[net.partition] = len(keys) + len(timer_keys) + 1
            deadline = net.wall_deadline
            arm = deadline is not None and net.header.get("pending") is not None
            args += [
                "r" if net.rewrite else "a",
                orjson.dumps(net.header),
                timer_at,
                "z" if arm else "x",
                sid,
                deadline if deadline is not None and arm else 0,
                joined_entries(net.entries),
            ]
        keys += [self._timers(partition) for partition in timer_keys]  # dicts keep insertion order
        keys += [self.keys.session_owner(partition) for partition in written]
        keys.append(self.keys.session_save(save_id or uuid.uuid4().hex))
        args.append(SAVE_MARK_TTL_S)
        outcome = await self._save_script(keys=keys, args=args)
        if isinstance(outcome, list):
            raise SessionsFenced([int(p) for p in outcome], "a newer owner took it")
        return len(merged)

    async def timers(self, partition: int) -> list[tuple[str, float]]:
        """(shopper, wall deadline) of the pending triggers of ``partition``."""
        raw = await self.redis.zrange(self._timers(partition), 0, -1, withscores=True)
        return [(member.decode(), score) for member, score in raw]
