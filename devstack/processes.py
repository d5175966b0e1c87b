"""Starting and stopping the local service processes of the embedded stack."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from devstack.errors import StackError


@dataclass(frozen=True)
class ManagedProcess:
    name: str
    pid: int
    port: int
    log: str
    started: str | None = None
    """Which process ``pid`` named when it was spawned (``process_identity``), so that a PID the
    system has since given to another process (after a reboot, or a long time) is told apart from
    ours; None where ``/proc`` does not tell, or in a state file written before it was recorded."""


def process_identity(pid: int) -> str | None:
    """The boot and the start time (clock ticks since boot) of process ``pid``: the same pair only
    for the same process. None where the process or ``/proc`` is not there."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command, which may hold spaces and parentheses
    return f"{boot}:{fields[19]}"  # field 22 of stat(5), counted from the state (field 3)


def reused(process: ManagedProcess) -> bool:
    """``process``'s PID now names another process: it is not ours to signal or to count as up."""
    if process.started is None:
        return False
    now = process_identity(process.pid)
    return now is not None and now != process.started


def running(process: ManagedProcess) -> bool:
    """``process`` itself still runs (not only some process with its PID)."""
    return alive(process.pid) and not reused(process)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1", timeout_s: float = 0.2) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout_s):
        return True
    return False


def listens_in_group(pgid: int, port: int) -> bool | None:
    """Whether a process of group ``pgid`` holds the listening TCP socket on ``port`` (IPv4 or IPv6);
    None where ``/proc`` cannot tell (not Linux)."""
    if not Path("/proc/net/tcp").exists():
        return None
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address "ADDR:PORT" in hex, state 0A = LISTEN, inode in field 9
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for pid in _group_members(pgid):
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return True
    return False


def _group_members(pgid: int) -> list[int]:
    """The pids of the live (not zombie) processes of group ``pgid``, from ``/proc``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, _ppid, group = stat[stat.rindex(")") + 2 :].split(maxsplit=3)[:3]
        if int(group) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


class _Interrupts:
    """Whether an interrupt must wait (``interrupts_deferred``): process-wide, as signals are."""

    deferred = 0
    pending = False


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """An interrupt that comes inside (``interrupt``, what the CLI's SIGTERM handler calls) is raised
    at the end of the block, not within it: a process forked inside is recorded before anything stops
    the start (raised inside ``Popen``, the child ran on with no one knowing its pid)."""
    _Interrupts.deferred += 1
    try:
        yield
    finally:
        _Interrupts.deferred -= 1
        if not _Interrupts.deferred and _Interrupts.pending:
            _Interrupts.pending = False
            raise KeyboardInterrupt


def interrupt() -> None:
    """Raise ``KeyboardInterrupt`` now, or at the end of the ``interrupts_deferred`` block running."""
    if _Interrupts.deferred:
        _Interrupts.pending = True
        return
    raise KeyboardInterrupt


def spawn(
    name: str,
    argv: Sequence[str],
    port: int,
    log_dir: Path,
    env: dict[str, str] | None = None,
    *,
    record: list[ManagedProcess] | None = None,
) -> ManagedProcess:
    """Start ``argv`` in its own session (so it outlives this CLI and can be stopped as a group), and
    append it to ``record`` (the processes a start stops again if it fails or is interrupted) before
    an interrupt can come."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with interrupts_deferred(), open(log, "ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        process = ManagedProcess(name, proc.pid, port, str(log), process_identity(proc.pid))
        if record is not None:
            record.append(process)
    return process


def wait_for_port(process: ManagedProcess, timeout_s: float = 30.0) -> None:
    """Until ``process`` listens on its port. Where ``/proc`` tells, the listener must be of its own
    process group: a port that ``free_port`` found free but another process took meanwhile was taken
    for the child's, which had exited with "address already in use", and the stack used whatever
    answered there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(process.port) and listens_in_group(process.pid, process.port) is not False:
            return
        if not alive(process.pid):
            raise StackError(
                f"{process.name} exited during start-up; see {process.log}:\n{_tail(process.log)}"
            )
        time.sleep(0.05)
    raise StackError(f"{process.name} did not open port {process.port} in {timeout_s} s; see {process.log}")


def wait_for_http(process: ManagedProcess, path: str = "/health", timeout_s: float = 60.0) -> None:
    """Until ``process`` answers 200 on ``path``. As in ``wait_for_port``, the answer counts only while
    the child lives and (where ``/proc`` tells) owns the listener: with the replicas' ports all chosen
    before any binds, a duplicate made one replica exit "address already in use" while its sibling
    answered for it."""
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{process.port}{path}"
    while time.monotonic() < deadline:
        if _answers(url) and alive(process.pid) and listens_in_group(process.pid, process.port) is not False:
            return
        if not alive(process.pid):
            raise StackError(
                f"{process.name} exited during start-up; see {process.log}:\n{_tail(process.log)}"
            )
        time.sleep(0.1)
    raise StackError(f"{process.name} did not answer {url} in {timeout_s} s; see {process.log}")


def _answers(url: str) -> bool:
    """A GET of ``url`` answers 200."""
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
        return bool(response.status == 200)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def group_alive(pgid: int) -> bool:
    """Any process of the group ``pgid`` (a process started in its own session) still runs. Zombies
    do not count: in a container whose first process reaps no orphans, a member that exited stays a
    zombie, and the group would read as alive for as long as the stop waits."""
    alive(pgid)  # reaps the leader if it is a zombie child of ours
    if not Path("/proc").is_dir():  # not Linux: any member, zombie or not
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return bool(_group_members(pgid))


def stop(process: ManagedProcess, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left of the group after ``timeout_s``. The
    whole group is waited for, not its leader only: a TaskManager's leader is the shell loop that
    restarts it, and once that shell had exited its JVM was never sent the SIGKILL. Nothing is sent
    where the PID names another process now (``reused``): a group of that ID is someone else's. (Linux
    gives no process a PID that a living process still has as its group ID, so a reused leader PID
    means no member of the old group is left.)"""
    if reused(process):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            if not group_alive(process.pid):
                return
            time.sleep(0.05)


def _tail(path: str, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    return ""
