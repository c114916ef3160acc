"""Byte counts as text, shared by the plan's table (``report.py``) and its reasons (``choose.py``, ``job.py``)."""

from __future__ import annotations


def format_bytes(nbytes: float) -> str:
    """Bytes in decimal units with three significant digits, e.g. ``"13.5 GB"``, ``"612 kB"``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
