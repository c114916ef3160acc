"""Process groups that live as long as the default group: one set per layout and process, shared by every user.

Creating a process group is collective and costly, and torch.distributed keeps every group it created (and gloo
keeps threads and sockets for each) until the default group is destroyed. A process that builds many strategies in
turn (a sweep, a test session, ``fit`` then ``predict``) would otherwise add a full set of groups per strategy and slow
every later collective. Groups are therefore created once per layout and default group, and reused.

The cache hangs off the default group object, weakly: when the default group is destroyed and torch lets go of it,
the cached groups are closed and dropped with it (they hold the rendezvous store, whose port would otherwise stay
busy), and a new default group starts with an empty cache.

Every rank must ask for the same keys in the same order, as with any collective: all ranks then miss the cache, and
create, together.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_by_world: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.RLock()


def cached_groups(key: Hashable, create: Callable[[], T]) -> T:
    """The groups stored under ``key`` for the current default group, made with ``create()`` on first use."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group before creating groups.")
    world = dist.group.WORLD
    with _lock:
        entries = _by_world.get(world)
        if entries is None:
            entries = {}
            _by_world[world] = entries
            weakref.finalize(world, _close_all, entries)
        if key not in entries:
            entries[key] = create()
        return entries[key]


def _close_all(entries: dict[Hashable, Any]) -> None:
    # Runs when the default group is gone: stop the threads of the cached objects so that nothing keeps their
    # process groups (and the store behind them) alive.
    for value in entries.values():
        close = getattr(value, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001  (the groups are dead already; nothing to report to)
                pass
    entries.clear()
