"""A module left sharded after a Trainer stage holds, in each parameter, only this rank's piece of it (a 1-D view of
the rank's shard); its ``state_dict()``, which would pass those pieces off as the weights, is refused with an error
that names the ways to read them in full."""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.hooks import RemovableHandle

_READ_GUARD = "_paro_sharded_read_guard"


def guard_sharded_reads(module: Optional[torch.nn.Module]) -> None:
    """A module left sharded holds local pieces, not its weights: refuse its ``state_dict()``, the usual way to read
    weights, with an error that says what to do instead; the strategies' own reads (``keep_vars=True``) go through.
    The handle lives on the module, so whichever strategy sets up on it next removes it."""
    if module is not None and getattr(module, _READ_GUARD, None) is None:
        object.__setattr__(module, _READ_GUARD, module.register_state_dict_pre_hook(_refuse_reading_sharded))


def drop_sharded_read_guard(module: Optional[torch.nn.Module]) -> None:
    handle: Optional[RemovableHandle] = getattr(module, _READ_GUARD, None) if module is not None else None
    if handle is not None:
        handle.remove()
        object.__setattr__(module, _READ_GUARD, None)


def _refuse_reading_sharded(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    if not keep_vars:
        raise RuntimeError(
            f"{type(module).__name__}'s parameters were left sharded across the ranks after the last Trainer stage"
            " (PaROStrategy gather='sharded', or 'auto' found they do not fit one rank), so it has no full values to"
            " read. Use trainer.strategy.export_full_state_dict(path) (collective: call it on every rank) or"
            " trainer.save_checkpoint(path), or pass gather=lightning_paro.GatherConfig(after_fit='full') to get them"
            " back in full."
        )
