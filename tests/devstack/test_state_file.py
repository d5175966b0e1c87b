"""The stack's state file holds passwords (a ``STACK_REDIS_URL`` with one, the S3 keys): it is created
readable by its owner only, whatever the umask and whatever file was there before."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from devstack.stack import StackState, load_state, state_file, write_private


def test_state_file_is_created_owner_only(tmp_path: Path) -> None:
    path = state_file(tmp_path)
    path.write_text("{}")
    path.chmod(0o666)  # a wide file from before
    previous = os.umask(0)  # nothing masked by the process either
    try:
        state = StackState("k:1", "redis://:pw@h:1/0", None, "b", [], "sim", "m")
        write_private(path, state.to_json())
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_state(tmp_path).redis_url == "redis://:pw@h:1/0"
    assert [p.name for p in tmp_path.iterdir()] == ["stack.json"], "no temporary file left"
    assert "pw" not in str(state.shown())
