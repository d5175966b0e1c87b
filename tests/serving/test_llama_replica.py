"""The real small model: one llama-server replica with Gemma 3 270M, driven through the client.

``make test`` builds the binary first, so a missing binary is a failure here, never a skip.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

from devstack.llama import LlamaReplica, ensure_gemma_model, llama_binary_path, llama_server_command
from llm_client import ClientConfig, LLMClient
from llm_client.routing.prefix_aware import PrefixAwarePolicy
from prompt_assembly.prompt import build_messages


def test_command_enables_the_prompt_cache(tmp_path: Path) -> None:
    argv = llama_server_command(
        8080, tmp_path / "m.gguf", binary=tmp_path / "llama-server", parallel=2, threads=1
    )
    assert "--cache-prompt" in argv and "--jinja" in argv
    assert argv[argv.index("--parallel") + 1] == "2" and argv[argv.index("--port") + 1] == "8080"


@pytest.mark.slow
@pytest.mark.llama
@pytest.mark.timeout(300)
async def test_llama_replica_reuses_a_shoppers_prefix() -> None:
    binary = llama_binary_path()
    assert binary.is_file() and os.access(binary, os.X_OK), (
        f"llama-server is not built at {binary}: run scripts/build-llama-server (make test does)"
    )
    model = ensure_gemma_model()
    lines = [
        f"- 2026-10-2{i % 10} 18:{i:02d} viewed: <data>Witch Costume Set {i}</data> by Spooktacular, "
        f"Costumes > Kids, ${20 + i}.99\n"
        for i in range(12)
    ]
    async with LlamaReplica(binary=binary, model_path=model, parallel=2, threads=2, ctx_size=8192) as replica:
        assert replica.process is not None
        pid = replica.process.pid
        config = ClientConfig.model_validate(
            {
                "endpoints": [replica.url],
                "policy": "prefix_aware",
                "timeouts": {"attempt_s": 120, "deadline_s": 240},
            }
        )
        policy = PrefixAwarePolicy()
        async with LLMClient(config, policy) as client:
            first = await client.chat(build_messages("s1", lines[:8]), routing_key="s1", max_tokens=8)
            second = await client.chat(build_messages("s1", lines), routing_key="s1", max_tokens=8)
        assert first.text and first.prompt_tokens > 100
        assert second.prompt_tokens > first.prompt_tokens
        # the whole previous prompt up to its newest log line is reused
        assert second.cached_tokens >= 0.7 * second.prompt_tokens, second
        assert client.endpoints[0].restarts_detected == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped on exit


# AVX-512 and AMX instructions as objdump prints them: zmm registers, opmask registers ({%k1}),
# ternary logic (EVEX only), and the AMX tile instructions ggml's AMX kernels use.
_NOT_PORTABLE = re.compile(rb"%zmm\d|%k[0-7]\b|vpternlog|ldtilecfg|tileloadd|tilestored|tdpb|tilezero")


@pytest.mark.slow
@pytest.mark.llama
@pytest.mark.timeout(300)
def test_llama_binary_has_no_avx512_or_amx_code() -> None:
    """The cached binary runs on every x86-64 machine of ours: a native build on a CPU with AMX
    segfaulted at start-up in ggml's AMX kernels (and would not run on a CPU without AVX-512)."""
    binary = llama_binary_path()
    assert binary.is_file(), f"llama-server is not built at {binary} (make test builds it)"
    if platform.machine() != "x86_64":
        pytest.fail("this check reads x86-64 code; add one for this architecture")
    flags = (binary.parent.parent / "build-flags.txt").read_text()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AMX_INT8=OFF" in flags, flags
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(binary)], check=True, capture_output=True
    ).stdout
    assert b"%ymm" in listing or "x86-64-v2" in flags, "no AVX2 code: the listing is not what we think"
    found = sorted({m.group().decode() for m in _NOT_PORTABLE.finditer(listing)})
    assert not found, f"{binary} holds AVX-512/AMX instructions: {found}"
