"""Exact weights out of a :class:`~lightning_paro.strategy.engine.PaROEngine`: evaluation stages and export.

Training may gather parameters rounded on the wire (``comm_dtypes``); everything here reads exact weights:

* :func:`exact_params` makes the parameter storage exact again, and :func:`exact_gathers` gathers in the
  parameters' own dtype inside a block (outside one, only the evaluation modes do);
* :func:`materialize` gathers every unit and keeps it gathered (mode FULL), :func:`release` frees what is sharded
  (back to training);
* :func:`begin_eval` ... :func:`end_eval` run a sharded evaluation stage (mode EVAL), the root unit gathered for the
  stage and the rounds kept by a :class:`ShardedEvaluation`;
* :func:`full_state_dict` copies the module's full tensors out, gathering one unit at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from lightning_paro.strategy.evaluation import ShardedEvaluation
from lightning_paro.strategy.flat import FlatGroup
from lightning_paro.strategy.hooks import Mode

if TYPE_CHECKING:
    from lightning_paro.strategy.engine import PaROEngine


def set_exact_gathers(flats: list[FlatGroup], mode: Mode) -> None:
    """A flat group's ``exact_gathers`` flag derives from the engine's mode: it gathers in ``comm_dtypes`` in training
    (SHARDED) only. The mode setter calls this (flat groups start with the flag off, the engine in SHARDED), and
    :func:`exact_gathers` sets the flag back from the mode when its block ends."""
    for f in flats:
        f.exact_gathers = mode is not Mode.SHARDED


@contextmanager
def exact_gathers(engine: PaROEngine) -> Iterator[None]:
    """Gathers in the parameters' own dtype inside the block, whatever the mode; after it, as the mode says."""
    flats = engine.flat_groups()
    for f in flats:
        f.exact_gathers = True
    try:
        yield
    finally:
        set_exact_gathers(flats, engine.mode)


def exact_params(engine: PaROEngine) -> None:
    """Drop gathered units rounded on the wire and run the OS -> P sync again in the parameters' own dtype."""
    for unit in engine.units:
        if any(f.gathered_rounded for f in unit.flats):
            unit.free()
    for f in engine.flat_groups():
        if f.trainable:
            f.exact_params()


def materialize(engine: PaROEngine) -> None:
    """Gather every unit, exact, and keep it gathered (mode FULL)."""
    engine.exact_params()
    with exact_gathers(engine):
        for unit in engine.units:
            unit.wait_param_sync()
            unit.gather(async_op=True)
        for unit in engine.units:
            unit.wait_gather()
    engine.mode = Mode.FULL


def release(engine: PaROEngine) -> None:
    """Free what is sharded; back to training mode."""
    for unit in engine.units:
        if unit.sharded_params:
            unit.free()
    engine.mode = Mode.SHARDED
    engine.evaluation = None


def begin_eval(engine: PaROEngine) -> None:
    """Start a sharded evaluation stage: the root unit gathered (exact) for the stage, the rounds handed to a
    :class:`ShardedEvaluation` over the last training forward's units. With P = N, :func:`materialize`."""
    if not engine.root.sharded_params:
        engine.materialize()
        return
    engine.wait()
    engine.release()
    engine.exact_params()
    with exact_gathers(engine):
        engine.root.ensure_ready()
    engine.evaluation = ShardedEvaluation(
        engine, [u for u in engine._order if u is not engine.root] or engine.units[:-1])
    engine.mode = Mode.EVAL


def eval_step_begin(engine: PaROEngine) -> None:
    if engine.mode is Mode.EVAL:
        engine.evaluation.step_begin()


def eval_step_end(engine: PaROEngine, last: bool) -> None:
    if engine.mode is Mode.EVAL:
        engine.evaluation.step_end(last)


def join(engine: PaROEngine) -> None:
    if engine.mode is Mode.EVAL:
        engine.evaluation.join()


def end_eval(engine: PaROEngine) -> None:
    """Join if the last step did not, then free what is sharded."""
    if engine.mode is Mode.EVAL:
        engine.join()
    if engine.mode in (Mode.EVAL, Mode.FULL):
        engine.release()


@torch.no_grad()
def full_state_dict(engine: PaROEngine, rank0_only: bool, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The module's state dict with full tensors copied to ``device``, gathered one unit at a time (a unit gathered
    before stays gathered); with ``rank0_only``, an empty dict on the other ranks."""
    engine.wait()
    engine.exact_params()
    keep = rank0_only is False or engine.comm.topology.rank == 0
    copies: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        was_gathered = all(f.gathered for f in unit.flats)
        with exact_gathers(engine):
            unit.ensure_ready()
        if keep:
            for f in unit.flats:
                for s in f.slots:
                    copies[id(s.param)] = s.param.detach().to(device, copy=True)
        if not was_gathered:
            unit.free()
    if not keep:
        return {}
    return {k: copies[id(v)] if id(v) in copies else v.detach().to(device, copy=True)
            for k, v in engine.module.state_dict(keep_vars=True).items()}
