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

Groups created here take the default group's timeout (:func:`default_timeout`): torch gives a new group its own
default (30 minutes on gloo) whatever ``init_process_group(timeout=...)`` said, and a collective on such a group
would wait that long for a peer that is gone.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Hashable, TypeVar

import torch
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
            # Not through the finalizer at interpreter exit (it would wait without bound for a thread still blocked
            # in a failed collective): _close_at_exit stops them there, with a deadline.
            weakref.finalize(world, _close_all, entries).atexit = False
        if key not in entries:
            entries[key] = create()
        return entries[key]


def default_timeout() -> timedelta:
    """The default process group's timeout, as given to ``init_process_group`` (torch's default if it cannot be
    read)."""
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001  (no backend for that device, or a torch without these internals)
            continue
    return dist.default_pg_timeout


def stall_limit(timeout_s: float) -> float:
    """How long a waiter lets a collective go without progress before it declares it failed: the backend's timeout
    plus a margin, so that the backend's own error (which names the peer and the message) normally comes first."""
    return timeout_s + max(5.0, 0.25 * timeout_s)


EXIT_DEADLINE_S = 5.0
"""How long interpreter exit waits for the cached threads to stop."""


def _close_at_exit() -> None:
    # The cached threads are daemons. Left running into interpreter finalization, one that is inside a torch call
    # when it next needs the GIL is ended by a forced unwind through C++ frames, which aborts the whole process
    # ("terminate called without an active exception") after it has done its work. Stop them first: idle ones return
    # at once; one blocked in a collective that will never finish (a peer died) is left behind after the deadline.
    with _lock:
        pending = [entries for entries in list(_by_world.values()) if entries]
    if not pending:
        return
    closer = threading.Thread(target=lambda: [_close_all(e) for e in pending], name="paro-exit", daemon=True)
    closer.start()
    closer.join(EXIT_DEADLINE_S)


atexit.register(_close_at_exit)


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
