"""What every stored benchmark result records about where it came from: the commit of the code measured (and
whether the package or the benchmark had uncommitted changes), the date and the machine.

``stamp()`` is written into each results file under ``"provenance"`` when a benchmark stores it; the results tables'
test (``tests/test_results_tables.py``) checks that every results file has one.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEY = "provenance"
FIELDS = ("commit", "date", "machine")
"""The fields a results file's provenance must hold."""


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine() -> dict[str, Any]:
    """The machine in words a reader can compare: CPU model and count, memory, accelerator, torch's version."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    out: dict[str, Any] = {"cpu": cpu, "cpus_usable": len(os.sched_getaffinity(0)), "memory_bytes": mem,
                           "system": f"{platform.system()} {platform.release()}", "python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return out


def stamp() -> dict[str, Any]:
    """Provenance of a result measured now from this checkout."""
    dirty = _git("status", "--porcelain", "--", "lightning_paro", "bench", ":!bench/results")
    return {"commit": _git("rev-parse", "HEAD") or None, "uncommitted_changes": bool(dirty),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine()}


def with_stamp(data: Any) -> Any:
    """``data`` (a results file's top-level object) with this run's provenance; a list is wrapped as ``rows``."""
    if isinstance(data, list):
        data = {"rows": data}
    return {**data, KEY: stamp()}


def missing(data: Any) -> list[str]:
    """The provenance fields a results file's object lacks (all of them when it has none)."""
    prov = data.get(KEY) if isinstance(data, dict) else None
    if not isinstance(prov, dict):
        return list(FIELDS)
    return [f for f in FIELDS if not prov.get(f)]
