"""A runner with input 'prompts' as a process of its own, as it is deployed beside the Flink job: its
settings arrive pickled on stdin (pickled, so that secrets travel as they are), it runs until SIGTERM,
which stops it as it stops ``shopper run`` (in-flight prompts finish, one last durable point and commit).

Used by ``bench.flink_kit.prompts_stage(process_log=...)``, where a runner on a thread of the benchmark's
own process would share its interpreter lock with the benchmark's producer and poller."""

from __future__ import annotations

import asyncio
import pickle
import sys

from runner.config import RunnerSettings
from runner.embedded import EmbeddedRunner


def main() -> None:
    settings = pickle.load(sys.stdin.buffer)
    if not isinstance(settings, RunnerSettings):
        raise SystemExit(f"expected pickled RunnerSettings on stdin, got {type(settings).__name__}")
    asyncio.run(EmbeddedRunner(settings, log=lambda line: print(line, file=sys.stderr, flush=True)).run())


if __name__ == "__main__":
    main()
