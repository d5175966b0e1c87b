"""aiperf in a virtualenv of its own, created once and cached, so the project's environment never sees its
dependencies (about 150 packages: transformers, datasets, pyarrow, plotly, zmq...).

``~/.cache/shopper-understanding/aiperf-venv`` (``$SHOPPER_AIPERF_VENV`` overrides) is made with the
project's interpreter (``python -m venv``), gets the pinned ``aiperf`` from PyPI through pip, and the
offline tokenizer (``offline_tokenizer.py``) under its ``hf/`` folder. A ``.installed`` stamp holding the
pins is written last: a folder without it (an install that was interrupted) or with other pins is
removed and made again; one with it is used as it is, with no network. A file lock keeps two benchmarks
started at once from building it twice.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

AIPERF_VERSION = "0.13.0"
PINS = (
    f"aiperf=={AIPERF_VERSION}",
    # the packages the offline tokenizer goes through, at the versions it was checked with
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "huggingface_hub==1.33.0",
)
VENV_ENV = "SHOPPER_AIPERF_VENV"
TOKENIZER_NAME = "local/shakespeare-wordlevel"
"""Written by ``offline_tokenizer.py`` (its ``NAME``), found by aiperf under ``hf/``."""
INSTALL_TIMEOUT_S = 1800
"""pip resolving and unpacking ~150 packages: 4.5 minutes on the 2 shared cores here with a cold cache."""


def venv_dir() -> Path:
    override = os.environ.get(VENV_ENV)
    return Path(override) if override else Path.home() / ".cache" / "shopper-understanding" / "aiperf-venv"


@dataclass(frozen=True)
class AiperfInstall:
    """A ready aiperf: its CLI, and the environment its runs need."""

    root: Path

    @property
    def cli(self) -> Path:
        return self.root / "bin" / "aiperf"

    @property
    def hf_home(self) -> Path:
        return self.root / "hf"

    def env(self) -> dict[str, str]:
        """The caller's environment without the project's Python settings, offline, with the tokenizer's
        Hugging Face home."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        return {**env, "HF_HOME": str(self.hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _stamp() -> str:
    return "\n".join(PINS) + "\n"


def ensure_aiperf(root: Path | None = None) -> AiperfInstall:
    """The cached install, made first if it is missing, partial or pinned differently (minutes, once)."""
    root = root or venv_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = root / ".installed"
        if not (stamp.is_file() and stamp.read_text() == _stamp()):
            _build(root)
            stamp.write_text(_stamp())
    return AiperfInstall(root)


def _build(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    print(f"installing {', '.join(PINS)} into {root} (once; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=INSTALL_TIMEOUT_S)
    python = root / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PINS],
        check=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    # -I: isolated, so the script's own folder (bench/aiperf/) is not on its import path
    subprocess.run(
        [str(python), "-I", str(Path(__file__).with_name("offline_tokenizer.py")), str(root / "hf")],
        check=True,
        timeout=INSTALL_TIMEOUT_S,
        env=AiperfInstall(root).env(),
    )
