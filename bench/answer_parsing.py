"""What reading answers as untrusted input costs: the client's typed decoding (``llm_client.answers``:
msgspec structs, byte limits, its own SSE line splitting) against a plain ``orjson.loads`` of the same
documents with no checks (what the client did before), per answer, measured in one run.

    python -m bench.answer_parsing [--tokens 200] [--repeat 2000]

A streamed answer is ``--tokens`` chunks of one token each plus a usage chunk (OpenAI's shape, as
trtllm-serve sends it); a body is one chat completion of the same text. No network: the bytes are
already in memory, so the figures are the parsing alone.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Callable

import orjson

from bench.common import machine, print_table
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
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    chunks, body, limits = stream_bytes(args.tokens), body_bytes(args.tokens), AnswerLimits()

    # read_stream is a coroutine: timed by awaiting it in this loop.
    async def typed_stream_us() -> float:
        await read_stream(_Response(chunks), limits, "r", 0.0)  # type: ignore[arg-type]
        started = time.perf_counter()
        for _ in range(args.repeat):
            await read_stream(_Response(chunks), limits, "r", 0.0)  # type: ignore[arg-type]
        return float((time.perf_counter() - started) / args.repeat * 1e6)

    rows = []
    plain_s = per_call_us(lambda: plain_stream(chunks), args.repeat)
    typed_s = await typed_stream_us()
    rows.append(
        [f"stream, {args.tokens} chunks", f"{plain_s:.0f}", f"{typed_s:.0f}", f"{typed_s / plain_s:.2f}x"]
    )
    plain_b = per_call_us(lambda: orjson.loads(body)["choices"][0]["message"]["content"], args.repeat)
    typed_b = per_call_us(lambda: parse_body(body, "r", 0.0), args.repeat)
    rows.append(
        [f"body, {args.tokens} tokens", f"{plain_b:.1f}", f"{typed_b:.1f}", f"{typed_b / plain_b:.2f}x"]
    )
    print(machine())
    print_table(["answer", "plain orjson µs", "typed + limits µs", "ratio"], rows)


if __name__ == "__main__":
    asyncio.run(main())
