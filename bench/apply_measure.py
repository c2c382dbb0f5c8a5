"""CPU and load figures of this machine's processes, read from /proc, for bench/apply.py.

Every function returns None where the figure cannot be read (a server in a container, a process
that has just exited, a system without /proc): the benchmarks then print "n/a".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from applier.embedded import PostgresServer

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of a live process, every thread included."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICK


def postmaster_pid(server: PostgresServer) -> int | None:
    """The postmaster of a local server (LocalCluster); None for a container."""
    data_dir = getattr(server, "data_dir", None)
    if data_dir is None:
        return None
    try:
        return int((Path(data_dir) / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def exited_cpu(server: PostgresServer) -> float | None:
    """User + system CPU seconds of every process of ``server`` that has exited so far: backends,
    walsenders and apply workers are the postmaster's children, and the kernel adds each one's
    times to the postmaster's when it collects them. None when the postmaster is not a local
    process (the testcontainers backend)."""
    pid = postmaster_pid(server)
    fields = None if pid is None else _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[13]) + int(fields[14])) / _TICK  # cutime + cstime


def server_cpu(server: PostgresServer) -> float | None:
    """User + system CPU seconds of the whole server so far: the postmaster, its live children
    (backends, walsenders, apply workers, the WAL writer, the checkpointer ...) and those that
    have exited."""
    pid = postmaster_pid(server)
    fields = None if pid is None else _stat_fields(pid)
    if fields is None:
        return None
    total = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        child = _stat_fields(entry.name)
        if child is not None and child[1] == str(pid):  # field 4: the parent
            total += int(child[11]) + int(child[12])
    return total / _TICK


@dataclass(frozen=True)
class MachineCpu:
    """The machine's CPU time so far, from the first line of /proc/stat, in seconds: ``busy`` is
    every state but idle and iowait."""

    busy: float
    total: float

    @staticmethod
    def now() -> MachineCpu | None:
        """The counters now; None without /proc/stat."""
        try:
            values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        # guest time is already counted in user time
        total = sum(values[:8])
        return MachineCpu((total - idle) / _TICK, total / _TICK)


def cores_busy(before: MachineCpu | None, after: MachineCpu | None, seconds: float) -> float | None:
    """How many cores the machine kept busy on average between two readings ``seconds`` apart
    (every process counted, this benchmark's and anyone else's)."""
    if before is None or after is None or seconds <= 0:
        return None
    return (after.busy - before.busy) / seconds


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg gives them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def peak_kb(pid: int) -> int:
    """A live process's peak resident size so far (VmHWM), in kB; 0 once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # just exited
        return 0
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), "VmHWM: 0 kB")
    return int(line.split()[1])


def delta(before: float | None, after: float | None) -> float | None:
    """``after - before``, or None when either is unknown."""
    return None if before is None or after is None else after - before
