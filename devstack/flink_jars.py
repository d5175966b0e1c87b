"""Provision the Flink Kafka connector jars from PyPI: ``python -m devstack.flink_jars [--check]``.

Where Maven Central is unreachable (this machine, many CI runners) the official connector still comes
from PyPI: the ``shigawire-apache-flink-libraries`` wheel redistributes Apache Flink jars unchanged.
This downloads that one wheel with pip (``--no-deps --require-hashes``: the wheel's own SHA-256 is
pinned), extracts **only** ``pyflink/lib/flink-connector-kafka.jar`` (flink-connector-kafka 4.0.1-2.0)
and ``pyflink/lib/kafka-clients.jar`` (kafka-clients 3.9.1), checks each jar's pinned SHA-256 and puts
them in ``flink_jobs.flink_connectors.connector_cache_dir()`` (``~/.cache/shopper-understanding/
flink-jars``), where the job finds them. The wheel's other jars (Flink 2.0 core, connector-base, JDBC)
are never extracted: they would clash with PyFlink 2.3's own.

Idempotent and cheap when the cache is already right (no network). A jar that is there but does not
match its checksum is replaced. Writes are atomic (temp file, fsync, rename), so a killed run never
leaves a half jar that a later run trusts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from devstack.errors import StackError
from flink_jobs.flink_connectors import (
    CONNECTOR_WHEEL,
    CONNECTOR_WHEEL_SHA256,
    PYPI_JARS,
    connector_cache_dir,
)

WHEEL_MEMBER_DIR = "pyflink/lib/"


class JarChecksumMismatch(StackError):
    """A jar (or the wheel) does not have its pinned SHA-256."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def missing_or_wrong(cache_dir: Path) -> list[str]:
    """Names of the pinned jars that are absent from ``cache_dir`` or have the wrong checksum."""
    return [
        name
        for name, expected in PYPI_JARS.items()
        if not (cache_dir / name).is_file() or sha256_of(cache_dir / name) != expected
    ]


def download_wheel(dest: Path, *, python: str = sys.executable) -> Path:
    """``pip download`` of the pinned wheel (its hash pinned too) into ``dest``; returns the file."""
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{CONNECTOR_WHEEL} --hash=sha256:{CONNECTOR_WHEEL_SHA256}\n")
    pip = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "--only-binary=:all:", "--require-hashes", "-r", str(requirements), "-d", str(dest)],
        check=True,
    )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise StackError(f"pip download left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def extract_jars(wheel: Path, cache_dir: Path, names: list[str]) -> None:
    """Extract ``names`` from the wheel's ``pyflink/lib/`` into ``cache_dir``, each verified before it
    is renamed into place."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        for name in names:
            tmp = cache_dir / f".{name}.partial"
            with archive.open(WHEEL_MEMBER_DIR + name) as src, open(tmp, "wb") as out:
                while block := src.read(1 << 20):
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            actual = sha256_of(tmp)
            if actual != PYPI_JARS[name]:
                tmp.unlink()
                raise JarChecksumMismatch(
                    f"{name} from {wheel.name}: SHA-256 {actual}, pinned {PYPI_JARS[name]}"
                )
            tmp.replace(cache_dir / name)


def provision(cache_dir: Path | None = None) -> list[Path]:
    """Make sure both pinned jars are in the cache; returns their paths."""
    folder = cache_dir or connector_cache_dir()
    todo = missing_or_wrong(folder)
    if todo:
        with tempfile.TemporaryDirectory(prefix="flink-jars-") as tmp:
            extract_jars(download_wheel(Path(tmp)), folder, todo)
    return [folder / name for name in PYPI_JARS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.flink_jars", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="verify only; exit 1 if missing or wrong")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: " + str(connector_cache_dir()))
    args = parser.parse_args(argv)
    folder = args.cache_dir or connector_cache_dir()
    if args.check:
        bad = missing_or_wrong(folder)
        for name in bad:
            print(f"missing or wrong: {folder / name}", file=sys.stderr)
        return 1 if bad else 0
    for jar in provision(folder):
        print(f"ok: {jar}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
