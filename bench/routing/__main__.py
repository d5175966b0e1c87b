"""``python -m bench.routing``."""

import asyncio

from bench.routing.cli import main

asyncio.run(main())
