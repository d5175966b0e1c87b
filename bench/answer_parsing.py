"""What reading answers as untrusted input costs: the client's typed decoding (``llm_client.answers``:
msgspec structs, byte limits, its own SSE line splitting) against a plain ``orjson.loads`` of the same
documents with no checks (what the client did before), per answer, measured in one run.

    python -m bench.answer_parsing [--tokens 200] [--repeat 2000] [--rounds 7]

Each round times the four cases back to back, so a ratio is taken within a round (the same moment of
the machine's load); the table gives the median µs and the median ratio with its range over the rounds,
and goes to ``bench/results/answer_parsing.json`` (``docs/benchmarks.md`` renders it from there).

A streamed answer is ``--tokens`` chunks of one token each plus a usage chunk (OpenAI's shape, as
trtllm-serve sends it); a body is one chat completion of the same text. No network: the bytes are
already in memory, so the figures are the parsing alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable

import orjson

from bench.common import load_average, machine, print_table, write_results
from llm_client.answers import AnswerLimits, parse_body, read_stream


class _Content:
    """Just enough of aiohttp's ``StreamReader`` for ``llm_client.answers``: ``iter_any`` over chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


class _Response:
    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)
        self.content_length: int | None = None


def stream_bytes(tokens: int) -> list[bytes]:
    chunks = [
        b"data: "
        + orjson.dumps({"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": f" tok{i}"}}]})
        + b"\n\n"
        for i in range(tokens)
    ]
    usage = {
        "prompt_tokens": 3000,
        "completion_tokens": tokens,
        "prompt_tokens_details": {"cached_tokens": 2900},
    }
    chunks.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
    return chunks


def body_bytes(tokens: int) -> bytes:
    text = "".join(f" tok{i}" for i in range(tokens))
    return orjson.dumps(
        {
            "model": "m",
            "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3000, "completion_tokens": tokens},
        }
    )


def plain_stream(chunks: list[bytes]) -> str:
    """The unchecked way: split lines, ``orjson.loads`` each, walk dicts."""
    parts: list[str] = []
    for line in b"".join(chunks).split(b"\n"):
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            chunk = orjson.loads(line[5:].strip())
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    parts.append(piece)
    return "".join(parts)


def per_call_us(fn: Callable[[], object], repeat: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=2000, help="calls timed per case and round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the four cases, interleaved")
    args = parser.parse_args()
    chunks, body, limits = stream_bytes(args.tokens), body_bytes(args.tokens), AnswerLimits()
    load_before = list(os.getloadavg())

    # read_stream is a coroutine: timed by awaiting it in this loop.
    async def typed_stream_us() -> float:
        await read_stream(_Response(chunks), limits, "r", 0.0)  # type: ignore[arg-type]
        started = time.perf_counter()
        for _ in range(args.repeat):
            await read_stream(_Response(chunks), limits, "r", 0.0)  # type: ignore[arg-type]
        return float((time.perf_counter() - started) / args.repeat * 1e6)

    runs: dict[str, list[float]] = {
        case: [] for case in ("plain_stream", "typed_stream", "plain_body", "typed_body")
    }
    for _ in range(args.rounds):
        runs["plain_stream"].append(per_call_us(lambda: plain_stream(chunks), args.repeat))
        runs["typed_stream"].append(await typed_stream_us())
        runs["plain_body"].append(
            per_call_us(lambda: orjson.loads(body)["choices"][0]["message"]["content"], args.repeat)
        )
        runs["typed_body"].append(per_call_us(lambda: parse_body(body, "r", 0.0), args.repeat))

    def row(label: str, case: str, digits: int) -> list[object]:
        plain, typed = runs[f"plain_{case}"], runs[f"typed_{case}"]
        ratios = [t / p for t, p in zip(typed, plain, strict=True)]
        return [
            label,
            f"{statistics.median(plain):.{digits}f}",
            f"{statistics.median(typed):.{digits}f}",
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]",
        ]

    print(machine())
    table = print_table(
        ["answer", "plain orjson µs", "typed + limits µs", f"ratio, median [range] of {args.rounds} rounds"],
        [
            row(f"streamed, {args.tokens} chunks", "stream", 0),
            row(f"one body, {args.tokens} tokens", "body", 1),
        ],
    )
    print(load_average())
    write_results(
        "answer_parsing.json",
        {"args": vars(args), "load_average_start": load_before, "runs_us": runs, "table": table},
    )


if __name__ == "__main__":
    asyncio.run(main())
