"""Links measured by an earlier job, kept on disk and reused once a cheap check confirms them.

The start-up probe (``probe.py``) costs seconds: a few all-gathers per link class, their overlap with compute and a
global HO-Ring gather. A job started again on the same hosts (a restart, the next run of a sweep) mostly meets the
same links, so rank 0 keeps the probe's figures in a JSON file named after what they depend on: the host of every
rank in rank order (which fixes the groups and which ranks share a host), the group size, the backend, the device
type, the HO-Ring chunk and the probe's own sizes. The next job with the same key times only the probe's large
all-gather on each link class again (:func:`~lightning_paro.planner.probe.check_seconds`, the same size, the least of
three timings after an untimed one: a few tenths of a second) and reuses the stored figures when every one is within
``TOLERANCE`` of the stored time (timed a second time before it gives up on them: a job's first gathers can be slow);
otherwise it runs the whole probe and stores the new figures. The optimizer update's bandwidth, timed at
start-up on the same hosts (``measure.py``), is kept in the same record by optimizer class and dtype
(:func:`store_update`), reused with links that pass the check and dropped with links that fail it. Every rank uses rank 0's file (broadcast), so every rank plans with the same
figures.

The directory is ``$LIGHTNING_PARO_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_paro``, else
``~/.cache/lightning_paro``; ``AutoConfig(link_cache=False)`` probes every time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_paro.planner.inputs import Link
from lightning_paro.planner.probe import (
    PILOT_BYTES,
    MeasuredLinks,
    check_seconds,
    probe_links,
)

FORMAT = 2
"""Version of the stored figures and of the probe that made them: a file of another version is not used."""

TOLERANCE = 2.0
"""A stored link is reused while its large all-gather takes between 1/TOLERANCE and TOLERANCE times its stored
time. Looser than the check's own noise (the least of three 10-100 ms timings; a 1-3 ms pilot's least time on
processors the ranks share moved up to 2.7x from one job to the next, which is why the check does not time it), tight
enough to catch a different fabric or link rate (10x between the benchmark's 100 Mbit/s and 1 Gbit/s)."""

ENV_DIR = "LIGHTNING_PARO_CACHE_DIR"


def cache_dir() -> Path:
    """Where stored links live: ``$LIGHTNING_PARO_CACHE_DIR``, ``$XDG_CACHE_HOME/lightning_paro`` or
    ``~/.cache/lightning_paro``."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightning_paro"


@dataclass(frozen=True)
class CachedLinks:
    """What :func:`links_for_job` used and how it got them."""

    links: MeasuredLinks
    """The figures the plan uses."""
    source: str
    """"probe" (measured now, no stored figures or stored ones that failed the check), "cache" (stored, checked)."""
    note: str
    """One line for the plan's notes: where the figures came from, and the check's ratios."""
    updates: dict[str, float] = field(default_factory=dict)
    """Update bandwidths stored with these links, by :func:`~lightning_paro.planner.measure.update_key` (empty
    when the links were probed now)."""
    path: Optional[Path] = None
    """The record's file (None: the cache is off)."""


def cache_key(hosts: list[str], group_size: int, backend: str, device_type: str, chunk_bytes: int,
              large_bytes: int) -> str:
    """File name (without suffix) of the stored links of one cluster layout; pure."""
    text = json.dumps({"format": FORMAT, "hosts": hosts, "group_size": group_size, "backend": backend,
                       "device": device_type, "chunk_bytes": chunk_bytes, "large_bytes": large_bytes,
                       "pilot_bytes": PILOT_BYTES}, sort_keys=True)
    return "links-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def links_to_json(links: MeasuredLinks, updates: Optional[dict[str, float]] = None) -> dict[str, Any]:
    return {"format": FORMAT, **dataclasses.asdict(links), "updates": dict(updates or {})}


def updates_from_json(data: Any) -> dict[str, float]:
    """The stored update bandwidths of a record, those that are positive numbers (none in a record without them)."""
    try:
        stored = data.get("updates") or {}
        return {str(k): float(v) for k, v in stored.items() if float(v) > 0}
    except (AttributeError, TypeError, ValueError):
        return {}


def links_from_json(data: Any) -> Optional[MeasuredLinks]:
    """The stored figures, or None when ``data`` is not a complete, valid record of this ``FORMAT`` (a file from
    another version, one edited by hand): the links are then probed again and the file replaced."""
    try:
        if data.get("format") != FORMAT:
            return None
        links = MeasuredLinks(intra=Link(**data["intra"]), inter=Link(**data["inter"]),
                              reduce_scatter_factor=float(data["reduce_scatter_factor"]),
                              hierarchical_factor=float(data["hierarchical_factor"]),
                              check_bytes=(int(data["check_bytes"][0]), int(data["check_bytes"][1])),
                              check_seconds=(float(data["check_seconds"][0]), float(data["check_seconds"][1])))
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return None
    sane = (links.reduce_scatter_factor > 0 and links.hierarchical_factor > 0 and min(links.check_seconds) >= 0
            and min(links.check_bytes) >= 0)
    return links if sane else None


def checks_agree(stored: tuple[float, float], measured: tuple[float, float],
                 tolerance: float | None = None) -> tuple[bool, list[float]]:
    """Whether every used link's measured check time is within ``tolerance`` (None: ``TOLERANCE``) of the stored one (a
    link class unused in one and used in the other disagrees), with the measured/stored ratio per used link; pure."""
    tolerance = TOLERANCE if tolerance is None else tolerance
    ratios, agree = [], True
    for old, new in zip(stored, measured):
        if old == 0 and new == 0:
            continue
        if old <= 0 or new <= 0:
            return False, ratios
        ratios.append(new / old)
        agree = agree and 1 / tolerance <= new / old <= tolerance
    return agree, ratios


def read_record(path: Path) -> tuple[Optional[MeasuredLinks], dict[str, float]]:
    """The stored links and the update bandwidths stored with them (None and {} without a valid record)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, {}
    links = links_from_json(data)
    return links, (updates_from_json(data) if links is not None else {})


def read_cached(path: Path) -> Optional[MeasuredLinks]:
    return read_record(path)[0]


def write_cached(path: Path, links: MeasuredLinks, updates: Optional[dict[str, float]] = None) -> None:
    """Write atomically (a temporary file renamed over the old one): a job reading it never sees half a file. A
    directory that cannot be written only costs the next job its probe."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**links_to_json(links, updates), "written": time.strftime("%Y-%m-%d %H:%M:%S")}))
        os.replace(tmp, path)
    except OSError:
        pass


def store_update(found: CachedLinks, key: str, bandwidth: float) -> None:
    """Keep an update bandwidth measured now in the record of the links ``found`` came from (on rank 0 only; a no-op
    with the cache off), for the next job that reuses those links."""
    import torch.distributed as dist

    if found.path is None or dist.get_rank() != 0:
        return
    links, updates = read_record(found.path)
    if links is not None:
        write_cached(found.path, links, {**updates, key: float(bandwidth)})


def links_for_job(topology, device, large_bytes: int, chunk_bytes: int, use_cache: bool = True) -> CachedLinks:
    """The links for a job's plan: stored ones that pass the check, else :func:`probe_links`'s (then stored).
    Collective: call on every rank; every rank gets rank 0's figures."""
    import torch.distributed as dist

    if not use_cache or topology.world_size == 1:  # one rank: no link to measure, nothing worth storing
        return CachedLinks(probe_links(topology, device, large_bytes=large_bytes, chunk_bytes=chunk_bytes), "probe",
                           "links measured by the start-up probe")
    world = topology.groups.world
    hosts = [None] * topology.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=world)
    path = cache_dir() / (cache_key(hosts, topology.group_size, dist.get_backend(world), device.type, chunk_bytes,
                                    large_bytes) + ".json")
    box = [read_record(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=world, device=device if device.type == "cuda" else None)
    stored, updates = box[0]
    why = "no stored links for these hosts and groups"
    if stored is not None:
        measured = check_seconds(topology, stored.check_bytes, device, chunk_bytes=chunk_bytes)
        agree, ratios = checks_agree(stored.check_seconds, measured)
        again = ""
        if not agree:
            # timed once more before the whole probe: on CPU processes sharing cores a job's first large gathers ran
            # 1.2-2.9x slower than its later ones over the same links; a changed link fails both timings
            second = check_seconds(topology, stored.check_bytes, device, chunk_bytes=chunk_bytes)
            agree, ratios = checks_agree(stored.check_seconds, tuple(map(min, measured, second)))
            again = ", timed twice"
        shown = ", ".join(f"{r:.2f}x" for r in ratios)
        if agree:
            return CachedLinks(stored, "cache", f"links from the link cache, checked: large all-gathers at {shown}"
                                                f" of the stored times (within {TOLERANCE:g}x{again})", updates, path)
        why = f"the stored links failed the check (large all-gathers at {shown} of the stored times{again})"
    links = probe_links(topology, device, large_bytes=large_bytes, chunk_bytes=chunk_bytes)
    if dist.get_rank() == 0:
        write_cached(path, links)
    return CachedLinks(links, "probe", f"links measured by the start-up probe ({why}; stored for the next job)",
                       path=path)
