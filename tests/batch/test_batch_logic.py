"""Pure batch logic: input rows, document splitting, prompts, map-reduce, AIMD, scheduling, shards."""

from __future__ import annotations

import random

import jsonschema
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batch.aimd import AimdController, AimdSettings, WindowStats
from batch.documents import (
    PRODUCT_SYSTEM_PROMPT,
    PromptBudget,
    map_messages,
    plan_document,
    prompt_tokens,
    reduce_groups,
    reduce_room,
    split_text,
)
from batch.lines import LineSplitter, OversizedLine
from batch.manifest import ShardBook
from batch.mapreduce import RecordWork
from batch.records import BadRecord, ProductRecord, parse_line
from batch.scheduler import JobDemand, allocate, pick_next
from batch.understanding import (
    ProductUnderstanding,
    parse_product_understanding,
    parse_unguided_product_understanding,
    product_json_schema,
)
from llm_client.errors import InvalidAnswer
from prompt_assembly.tokens import count_tokens, messages_text, tokenize

# ---- input rows ----------------------------------------------------------------------------------


def _line(**body: object) -> bytes:
    return orjson.dumps({"custom_id": "c1", "body": {"title": "Witch Costume", **body}})


def test_parse_line_builds_the_document_from_text_and_reviews() -> None:
    record = parse_line(3, _line(text="Soft fabric.", reviews=["Great!", "  "], price=24.99))
    assert record.line == 3 and record.product_id == "c1"
    assert record.document == "Soft fabric.\n\nReview: Great!"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"custom_id": "c1", "body": {"title": "cut', "unparseable"),
        (b"[1, 2]", "unparseable"),
        (b'{"body": {"title": "no id"}}', "invalid"),
        (orjson.dumps({"custom_id": "c1", "body": {"price": "free"}}), "invalid"),
        (orjson.dumps({"custom_id": "c1", "body": {"title": "t", "price": True}}), "invalid"),  # read as $1
        (orjson.dumps({"custom_id": "c1", "body": {"title": "t", "price": -1}}), "invalid"),
        (orjson.dumps({"custom_id": "c1", "url": "/v1/chat/completions", "body": {}}), "invalid"),
        (orjson.dumps({"custom_id": "c1", "body": {"title": "  ", "text": ""}}), "empty"),
        # nothing a model would see: a bidi override, control characters (they were sent, untitled)
        (orjson.dumps({"custom_id": "c1", "body": {"title": "\u202e", "text": "\x00\u2028\x7f"}}), "empty"),
    ],
)
def test_bad_lines_say_why(raw: bytes, reason: str) -> None:
    with pytest.raises(BadRecord) as caught:
        parse_line(0, raw)
    assert caught.value.reason == reason
    assert caught.value.message


def test_a_run_of_whitespace_is_cut_to_what_the_budget_counts() -> None:
    """The stand-in tokenizer counts a run of whitespace as one token: five megabytes of spaces passed
    the prompt budget as a short document, and a real server would refuse the prompt."""
    record = parse_line(0, _line(text="Warm" + " " * 5_000_000 + "hat.\n\n\n\nSoft."))
    assert record.document == "Warm" + " " * 16 + "hat.\n\n\n\nSoft."
    chart = parse_line(0, _line(text="Size chart:" + " " * 20 + "\nS  M  L"))
    assert chart.document == "Size chart:" + " " * 16 + "\nS  M  L", "a line cut stays a line of its own"


def test_unparseable_line_keeps_its_custom_id_when_readable() -> None:
    with pytest.raises(BadRecord) as caught:
        parse_line(0, b'{"custom_id": "prod-7", "body": {"title": "cut')
    assert caught.value.custom_id == "prod-7"


# ---- splitting and prompts -----------------------------------------------------------------------

_words = st.sampled_from(
    ["Soft", " fabric", ".", "\n", "\n\n", " kids", " love", " it", "!", " 12", "  ", "costume"]
)
_texts = st.lists(_words, min_size=0, max_size=400).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=_texts, max_tokens=st.integers(1, 60))
def test_split_is_lossless_and_bounded(text: str, max_tokens: int) -> None:
    parts = split_text(text, max_tokens)
    assert "".join(parts) == text
    assert all(count_tokens(p) <= max_tokens for p in parts)
    n = count_tokens(text)
    assert len(parts) <= max(1, -(-n // max(1, (3 * max_tokens) // 4)) + 1)


def test_split_prefers_paragraph_breaks() -> None:
    paragraph = "Soft fabric for kids. " * 10
    text = paragraph + "\n\n" + paragraph + "\n\n" + paragraph
    parts = split_text(text, count_tokens(paragraph) + 10)
    assert [p.rstrip("\n") for p in parts] == [paragraph] * 3


def _record(document: str, title: str = "Witch Costume Set") -> ProductRecord:
    return ProductRecord(
        line=0, custom_id="c1", product_id="p1", title=title, brand="Spooktacular",
        category="Costumes > Kids", price=24.99, document=document,
    )  # fmt: skip


_SMALL = PromptBudget(context_tokens=800, max_output_tokens=100, margin_tokens=8, max_parts=40)


@settings(max_examples=60, deadline=None)
@given(paragraphs=st.lists(st.integers(1, 400), min_size=1, max_size=12), seed=st.integers(0, 1000))
def test_every_map_prompt_fits_and_shares_the_product_prefix(paragraphs: list[int], seed: int) -> None:
    rng = random.Random(seed)
    words = ["soft", "fabric", "kids", "love", "bright", "Glow", "12", "party"]
    document = "\n\n".join(" ".join(rng.choice(words) for _ in range(n)) + "." for n in paragraphs)
    plan = plan_document(_record(document), _SMALL)
    assert "".join(plan.parts) == document
    prompts = [map_messages(plan.header, part, i, len(plan.parts)) for i, part in enumerate(plan.parts)]
    for messages in prompts:
        assert prompt_tokens(messages) <= _SMALL.max_prompt_tokens
        assert prompt_tokens(messages) == count_tokens(messages_text(messages))
        assert messages[0]["content"] == PRODUCT_SYSTEM_PROMPT
        assert messages[1]["content"].startswith(plan.header)
    # The shared prefix (system message + header) is the same tokens in every prompt of the product.
    prefix = tokenize(messages_text(prompts[0]))[: count_tokens(messages_text(prompts[0][:1])) + 3]
    for messages in prompts:
        assert tokenize(messages_text(messages))[: len(prefix)] == prefix


def test_documents_beyond_any_split_are_oversized() -> None:
    budget = PromptBudget(context_tokens=700, max_output_tokens=120, margin_tokens=8, max_parts=3)
    with pytest.raises(BadRecord) as caught:
        plan_document(_record("word " * 5000), budget)
    assert caught.value.reason == "oversized" and "at most 3" in caught.value.message
    with pytest.raises(BadRecord) as caught:
        plan_document(_record("short", title="Huge title " * 300), budget)
    assert caught.value.reason == "oversized" and "header" in caught.value.message


def test_a_document_needing_exactly_max_parts_parts_is_accepted() -> None:
    document = "word " * 5000
    plan = plan_document(_record(document), _SMALL)
    # Two digits either way: the part label ("part 3 of 14") is counted against each prompt's room.
    assert 10 <= len(plan.parts) < 40
    exact = _SMALL.model_copy(update={"max_parts": len(plan.parts)})
    assert plan_document(_record(document), exact).parts == plan.parts
    one_fewer = _SMALL.model_copy(update={"max_parts": len(plan.parts) - 1})
    with pytest.raises(BadRecord) as caught:
        plan_document(_record(document), one_fewer)
    assert caught.value.reason == "oversized"


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(1, 50), min_size=1, max_size=60), room=st.integers(100, 400))
def test_reduce_groups_cover_everything_and_shrink(tokens: list[int], room: int) -> None:
    groups = reduce_groups(tokens, room)
    assert [i for g in groups for i in g] == list(range(len(tokens)))
    for g in groups[:-1]:
        assert len(g) >= 2
    for g in groups:
        if len(g) > 2:
            assert sum(tokens[i] for i in g) <= room
    if len(tokens) > 1:
        assert len(groups) <= -(-len(tokens) // 2)


def _answer(tag: str) -> ProductUnderstanding:
    return ProductUnderstanding(
        segments=[f"segment {tag}"],
        occasions=["party"],
        style="fun",
        price_tier="mid",
        summary=f"summary {tag}",
    )


@pytest.mark.parametrize("seed", range(5))
def test_map_reduce_ends_with_one_answer_whatever_the_order(seed: int) -> None:
    rng = random.Random(seed)
    budget = PromptBudget(context_tokens=600, max_output_tokens=60, margin_tokens=8, max_parts=64)
    document = "\n\n".join("Soft bright fabric kids love. " * rng.randint(5, 30) for _ in range(25))
    plan = plan_document(_record(document), budget)
    assert len(plan.parts) > 8
    work = RecordWork(_record(document), plan, budget)
    pending = work.initial_calls()
    reduces = 0
    while pending:
        rng.shuffle(pending)
        call = pending.pop()
        if call.kind == "reduce":
            reduces += 1
            assert prompt_tokens(call.messages) <= budget.max_prompt_tokens
            assert call.messages[1]["content"].startswith(plan.header)
        pending += work.on_answer(call, _answer(f"{call.level}.{call.index}"))
    assert work.result is not None
    assert work.requests == len(plan.parts) + reduces
    assert reduces >= 1 and reduce_room(plan.header, budget) > 0


def test_one_part_needs_no_reduce() -> None:
    plan = plan_document(_record("Soft fabric."), PromptBudget())
    work = RecordWork(_record("Soft fabric."), plan, PromptBudget())
    (call,) = work.initial_calls()
    assert work.on_answer(call, _answer("x")) == [] and work.result == _answer("x")
    assert work.on_answer(call, _answer("y")) == [] and work.result == _answer("x")  # a late duplicate


# ---- AIMD ------------------------------------------------------------------------------------------


def _pool(limit: int, knee: int = 192) -> tuple[float, float]:
    """A continuous-batching server: throughput grows until the batch is full, then requests queue."""
    busy = min(limit, knee)
    step = 0.4 + 0.6 * busy / knee
    return busy / step, step * max(1.0, limit / knee)


@pytest.mark.parametrize("seed", range(6))
def test_aimd_settles_just_above_the_knee(seed: int) -> None:
    rng = random.Random(seed)
    controller = AimdController(AimdSettings(), budget=2048)
    limits = []
    for _ in range(200):
        rps, latency = _pool(controller.limit)
        window = WindowStats(int(rps * rng.gauss(1, 0.05)), 0, 1.0, latency * rng.gauss(1, 0.05), True)
        controller.update(window)
        limits.append(controller.limit)
    settled = limits[20:]
    assert min(settled) >= 192, "below the knee the pool idles"
    assert sum(settled) / len(settled) <= 2.5 * 192, "far beyond the knee requests only queue"
    assert limits.index(next(x for x in limits if x >= 192)) <= 6, "slow start reaches the knee fast"


def test_aimd_backs_off_on_errors_and_holds_without_demand() -> None:
    controller = AimdController(AimdSettings(initial_limit=100), budget=1000)
    assert controller.update(WindowStats(100, 10, 1.0, 1.0, True)).limit == 70
    assert controller.update(WindowStats(100, 0, 1.0, 1.0, False)).limit == 70
    controller.rescale(0.5)
    assert controller.limit == 35
    controller.set_budget(20)
    assert controller.limit == 20


_windows = st.lists(
    st.tuples(st.integers(0, 500), st.integers(0, 50), st.floats(0.01, 5.0), st.booleans()), max_size=80
)


@settings(max_examples=200, deadline=None)
@given(windows=_windows, budget=st.integers(1, 600))
def test_aimd_limit_stays_in_bounds_and_errors_never_raise_it(
    windows: list[tuple[int, int, float, bool]], budget: int
) -> None:
    s = AimdSettings(min_limit=2)
    controller = AimdController(s, budget=budget)
    for completions, errors, latency, limited in windows:
        before = controller.limit
        after = controller.update(WindowStats(completions, errors, 1.0, latency, limited)).limit
        assert min(s.min_limit, budget) <= after <= max(s.min_limit, budget)
        if errors >= 2 and errors / max(completions + errors, 1) > s.error_threshold:
            assert after <= before


# ---- scheduling ------------------------------------------------------------------------------------

_demands = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=6
).map(lambda rows: [JobDemand(f"j{i}", p, float(i), f, r) for i, (p, f, r) in enumerate(rows)])


@settings(max_examples=300, deadline=None)
@given(jobs=_demands, limit=st.integers(0, 120))
def test_allocation_is_strict_by_priority_and_fair_within(jobs: list[JobDemand], limit: int) -> None:
    shares = allocate(limit, jobs)
    assert sum(shares.values()) <= limit
    assert sum(shares.values()) == min(limit, sum(j.wants for j in jobs))
    for job in jobs:
        assert 0 <= shares[job.job_id] <= job.wants
    for low in jobs:
        if shares[low.job_id] > 0:
            for high in jobs:
                if high.priority > low.priority:
                    assert shares[high.job_id] == high.wants, "a lower level got slots a higher one wanted"
    for a in jobs:
        for b in jobs:
            if a.priority == b.priority and shares[a.job_id] < a.wants:
                assert shares[b.job_id] <= shares[a.job_id] + 1, "equal priorities share evenly"


@settings(max_examples=300, deadline=None)
@given(jobs=_demands, limit=st.integers(1, 120))
def test_pick_next_dispatches_whenever_a_slot_and_work_exist(jobs: list[JobDemand], limit: int) -> None:
    picked = pick_next(limit, jobs)
    in_flight = sum(j.in_flight for j in jobs)
    if in_flight >= limit or not any(j.ready for j in jobs):
        assert picked is None
    else:
        assert picked is not None
        job = next(j for j in jobs if j.job_id == picked)
        assert job.ready > 0


def test_higher_priority_takes_free_slots_first() -> None:
    low = JobDemand("low", 0, 0.0, in_flight=10, ready=100)
    high = JobDemand("high", 5, 1.0, in_flight=0, ready=100)
    assert pick_next(12, [low, high]) == "high"
    assert allocate(12, [low, high]) == {"high": 12, "low": 0}


# ---- shards ----------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    lines=st.integers(0, 60),
    shard=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    done=st.sets(st.integers(0, 8)),
)
def test_every_shard_commits_once_with_all_its_rows(
    lines: int, shard: int, seed: int, done: set[int]
) -> None:
    book = ShardBook(shard, committed=done)
    todo = [i for i in range(lines) if i // shard not in done]
    random.Random(seed).shuffle(todo)
    commits = []
    read = 0
    for line in todo:
        # The reader runs ahead of completions: seal what it has "read" so far.
        read = max(read, line + 1)
        commits += book.seal_through(read)
        commits += book.add(line, {"line": line}, error=line % 7 == 0, requests=1)
    commits += book.finish(lines)
    shards = [c.shard for c in commits]
    assert len(shards) == len(set(shards))
    expected = {i // shard for i in todo}
    assert set(shards) == expected
    for c in commits:
        got = [r["line"] for r in c.rows + c.errors]
        assert sorted(got) == [i for i in range(c.shard * shard, min(lines, (c.shard + 1) * shard))]
        assert [r["line"] for r in c.rows] == sorted(r["line"] for r in c.rows)
        assert c.counts.ok + c.counts.errors == len(got) and c.counts.requests == len(got)
    assert book.open_records == 0
    # A row for a committed shard (committed before the run or in it) never reopens it.
    for line in range(lines):
        assert book.add(line, {"line": line}, error=False, requests=1) == []
    assert book.open_records == 0


# ---- input lines ---------------------------------------------------------------------------------

_line_bytes = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=12)


@settings(max_examples=300, deadline=None)
@given(lines=_line_bytes, trailing_newline=st.booleans(), cap=st.integers(1, 30), cuts=st.data())
def test_line_splitter_gives_every_line_and_holds_at_most_the_cap(
    lines: list[bytes], trailing_newline: bool, cap: int, cuts: st.DataObject
) -> None:
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    points = sorted(cuts.draw(st.lists(st.integers(0, len(data)), max_size=8)))
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    splitter = LineSplitter(cap)
    out: list[bytes | OversizedLine] = []
    for chunk in chunks:
        out += splitter.feed(chunk)
        assert splitter.buffered_bytes <= cap
    out += splitter.end()
    expected_lines = data.split(b"\n")
    if expected_lines and expected_lines[-1] == b"":
        expected_lines.pop()  # a final newline ends the last line; it does not start an empty one
    assert out == [line if len(line) <= cap else OversizedLine(len(line)) for line in expected_lines]


def test_a_line_longer_than_the_cap_is_dropped_as_it_arrives() -> None:
    cap = 8
    splitter = LineSplitter(cap)
    piece = b"x" * (cap // 2 + 1)
    assert splitter.feed(b"ok\n" + piece) == [b"ok"]
    assert splitter.feed(piece) == [] and splitter.buffered_bytes == 0
    assert splitter.feed(piece + b"\nnext") == [OversizedLine(3 * len(piece))]
    assert splitter.end() == [b"next"]


GOOD_PRODUCT_ANSWER = {
    "segments": ["parents of school-age kids"],
    "occasions": ["halloween"],
    "style": "playful",
    "price_tier": "mid",
    "summary": "A kids witch costume.",
}
OFF_SCHEMA_PRODUCT_ANSWERS = {
    "a field the schema does not allow": (
        {**GOOD_PRODUCT_ANSWER, "audience": "kids"},
        "does not allow: 'audience'",
    ),
    "occasions missing": (
        {k: v for k, v in GOOD_PRODUCT_ANSWER.items() if k != "occasions"},
        "missing: 'occasions'",
    ),
    "a wrong price tier": ({**GOOD_PRODUCT_ANSWER, "price_tier": "cheap"}, "price_tier"),
}


def test_parse_product_understanding_accepts_an_answer_the_schema_accepts() -> None:
    jsonschema.validate(GOOD_PRODUCT_ANSWER, product_json_schema())
    parsed = parse_product_understanding(orjson.dumps(GOOD_PRODUCT_ANSWER).decode())
    assert parsed.model_dump() == GOOD_PRODUCT_ANSWER


@pytest.mark.parametrize("case", OFF_SCHEMA_PRODUCT_ANSWERS)
def test_parse_product_understanding_refuses_what_the_schema_refuses(case: str) -> None:
    """The model ignores extra fields and defaults ``occasions`` to none (it reads stored rows); an
    answer is held to the schema the server was asked to decode with, as the shopper's is."""
    answer, says = OFF_SCHEMA_PRODUCT_ANSWERS[case]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(answer, product_json_schema())
    text = orjson.dumps(answer).decode()
    with pytest.raises(InvalidAnswer) as refused:
        parse_product_understanding(text)
    assert refused.value.kind == "schema" and refused.value.raw == text
    assert says in str(refused.value)


def test_without_a_schema_sent_an_answer_is_held_to_the_model_only() -> None:
    """``guided_json`` off: no schema went to the server, so an extra field is ignored and missing
    ``occasions`` are none; a wrong value is still refused."""
    extra, _ = OFF_SCHEMA_PRODUCT_ANSWERS["a field the schema does not allow"]
    missing, _ = OFF_SCHEMA_PRODUCT_ANSWERS["occasions missing"]
    assert parse_unguided_product_understanding(orjson.dumps(extra).decode()).style == "playful"
    assert parse_unguided_product_understanding(orjson.dumps(missing).decode()).occasions == []
    wrong, _ = OFF_SCHEMA_PRODUCT_ANSWERS["a wrong price tier"]
    with pytest.raises(InvalidAnswer):
        parse_unguided_product_understanding(orjson.dumps(wrong).decode())
