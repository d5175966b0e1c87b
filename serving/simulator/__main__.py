"""Run one simulated replica: ``python -m serving.simulator --port 8001 --replica-id r0 --time-scale 0.01``.

Every ``SimulatorConfig`` field is a flag (``--cache-capacity-blocks``...) and a ``SIM_*`` variable; flags
win. Prints the effective configuration as one JSON line (with ``kv_memory``: GPU memory, weights,
activations and the KV blocks they leave), then ``READY http://HOST:PORT`` once listening
(with the real port when ``--port 0``), which is what launchers wait for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from serving.http_service import serve_until_stopped
from serving.simulator.app import create_app
from serving.simulator.config import SimulatorConfig
from serving.simulator.trtllm_options import simulator_settings


def parse_args(argv: Sequence[str] | None = None) -> SimulatorConfig:
    parser = argparse.ArgumentParser(prog="python -m serving.simulator", description=__doc__)
    for name, field in SimulatorConfig.model_fields.items():
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS, help=field.description
        )
    overrides = vars(parser.parse_args(argv))
    return SimulatorConfig(**overrides)


async def serve(config: SimulatorConfig) -> None:
    # Like trtllm-serve, abandon a request whose client went away (its deadline passed) instead of
    # spending replica time on an answer nobody reads.
    await serve_until_stopped(create_app(config), config.host, config.port, handler_cancellation=True)


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    # One line: the settings, and how the GPU's memory sized the KV cache (whatever the override).
    effective = {**config.model_dump(mode="json"), "kv_memory": asdict(config.kv_memory())}
    if config.extra_llm_api_options is not None:  # what the options file says that changes nothing here
        effective["ignored_trtllm_options"] = simulator_settings(config.extra_llm_api_options)[1]
    print(json.dumps(effective, sort_keys=True), flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
