"""Which processes a worker can see die: the identity of a worker's process, and whether it still runs.

A worker records its pid, the start time of that pid and its *process space* (the kernel's boot id and the pid
namespace) in the ledger. Another worker in the same space (the same machine, container or pod) can then tell at
once that the process is gone, instead of waiting for its lease to expire; the start time tells a reused pid from
the original process. Workers in other spaces (other machines) are judged by their heartbeats alone.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

_PROC = Path("/proc")


@functools.lru_cache(maxsize=1)
def local_process_space() -> Optional[str]:
    """``<boot id>/<pid namespace>`` of this process, or None where the system does not tell (no Linux /proc).

    Two processes see each other's pids exactly when both parts are equal: the same running kernel and the same pid
    namespace (containers on one machine share the boot id but not the namespace).
    """
    try:
        boot_id = (_PROC / "sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink(_PROC / "self/ns/pid")
    except OSError:
        return None
    return f"{boot_id}/{namespace}" if boot_id and namespace else None


def process_started(pid: int) -> Optional[int]:
    """When ``pid`` started, in clock ticks since boot (Linux), or None if it does not run or cannot be read."""
    stat = _read_stat(pid)
    return None if stat is None else int(stat[19])


def process_gone(pid: int, started: Optional[int]) -> bool:
    """Whether the process ``pid`` that started at ``started`` (ticks since boot) has ended.

    A zombie (killed, not yet reaped by its parent) has ended; a pid now held by a process that started at another
    time is a reused pid, and the original has ended. A process that exists but whose details cannot be read (another
    user's, under a /proc mounted with ``hidepid``; a system without /proc) is taken as running.
    """
    if pid <= 0:  # not a process of its own (0 and -1 would name groups of processes)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        pass
    stat = _read_stat(pid)
    if stat is None:
        return False
    if stat[0] in ("Z", "X", "x"):
        return True
    return started is not None and int(stat[19]) != started


def _read_stat(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        text = (_PROC / str(int(pid)) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # the command name is in parentheses and may itself hold spaces or parentheses: split after the last one
    return text[text.rfind(")") + 2 :].split()
