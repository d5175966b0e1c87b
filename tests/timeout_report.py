"""A test past its timeout ends the run with a report whose last lines name it.

pytest-timeout's thread method prints every thread's stack and then the test's captured output, so
the last lines of a CI log (often all that is kept) show some thread's frames and never say which
test hung. This timer prints the stacks (pytest-timeout's own ``dump_stacks``), then where each
pending asyncio task is suspended (a hung async test's main thread is always in the event loop's
``select``, which says nothing), the tail of what the test printed (a runner's progress lines say
whether it was still moving, and what an until-drained run waits for), the tail of any fixture that
offers a ``timeout_report()`` (a runner's kept log), then the test's id, and ends the run as
pytest-timeout does (``os._exit``: a hung thread cannot be joined).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import traceback
from typing import Any

import pytest
from pytest_timeout import dump_stacks

CAPTURED_TAIL_LINES = 12
"""The captured output lines repeated just above the test's id."""

TASKS_SHOWN = 40
"""Pending asyncio tasks whose await chains are printed (the rest are counted)."""


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Own the thread-method timer (pytest-timeout's own still serves the signal method)."""
    if settings.method != "thread":
        return None
    timer = threading.Timer(settings.timeout, _timed_out, (item, settings.timeout))
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout's cancel hook calls it
    timer.start()
    return True


def _timed_out(item: pytest.Item, timeout: float) -> None:
    terminal = item.config.get_terminal_writer()
    try:
        stdout, stderr = "", ""
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(item)
            stdout, stderr = capman.read_global_capture()
        terminal.sep("+", title=f"Timeout: {item.nodeid}")
        dump_stacks(terminal)  # pytest-timeout's own: every thread but this one
        _dump_tasks(terminal)
        captured = (stdout + stderr).splitlines()
        terminal.sep("~", title=f"last {CAPTURED_TAIL_LINES} of {len(captured)} captured lines")
        terminal.write("".join(f"{line}\n" for line in captured[-CAPTURED_TAIL_LINES:]))
        for name, value in getattr(item, "funcargs", {}).items():
            report = getattr(value, "timeout_report", None)
            if callable(report):  # a fixture that keeps a story of its own (tests.fault_kit.RunnerLog)
                terminal.sep("~", title=name)
                terminal.write(f"{report()}\n")
        terminal.write(f"TIMEOUT after {timeout:.0f} s in {item.nodeid}\n")
    except Exception:  # the report is best effort; ending the run is not
        traceback.print_exc()
    finally:
        terminal.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _dump_tasks(terminal: Any) -> None:
    """Each pending task's await chain, innermost last: the line it is suspended on. Read from this
    thread while the loop's thread sleeps in ``select`` (best effort: a task may move meanwhile)."""
    tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
    terminal.sep("~", title=f"{len(tasks)} pending asyncio tasks")
    for task in tasks[:TASKS_SHOWN]:
        chain = " -> ".join(awaiting(task.get_coro()))
        terminal.write(f"{task.get_name()}: {chain}\n")
    if len(tasks) > TASKS_SHOWN:
        terminal.write(f"... and {len(tasks) - TASKS_SHOWN} more\n")


def awaiting(coro: Any) -> list[str]:
    """``file:line in function`` of every coroutine in ``coro``'s await chain, outermost first."""
    chain: list[str] = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        code = frame.f_code
        chain.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    if coro is not None and not chain:
        chain.append(type(coro).__name__)
    return chain
