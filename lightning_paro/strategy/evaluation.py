"""Sharded evaluation: ``validate``, ``test`` and ``predict`` with units gathered one at a time, on ranks that may run
different numbers of batches.

Lightning's predict sampler does not pad, so ranks may run different numbers of steps, but every gather is a
collective over the P scope. So evaluation goes in rounds, one per step: each rank first adds a "still running" flag
into one scalar all-reduce over that scope. A rank that has run its last step keeps taking part in the rounds with a
0 and, while any peer still runs, issues the gathers of one step without computing, until a round counts no rank
running. The gathers such a rank replays are the sequence of units of the latest step every rank ran (the same on
every rank, since all of them issued those gathers together); in a round where a peer has finished, a running rank
must use its units in that order.

The engine (``engine.py``) owns the units and the hooks; it hands each evaluation stage to one
:class:`ShardedEvaluation`, which keeps the stage's rounds.

The strategy's side of a stage is here too, as plain functions its hooks call: whether the stage holds the whole
model (:func:`gather_in_full`, for ``gather="full"``, ``"sharded"`` or ``"auto"``), the stage begun in full or
sharded (:func:`begin_stage`), and each step run in its round (:func:`run_step`, told by :func:`is_last_batch`
when the rank has run its last batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning_paro.strategy.hooks import Mode
from lightning_paro.strategy.levels import Level
from lightning_paro.strategy.transitions import SCOPE_OF

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_paro.strategy.engine import PaROEngine
    from lightning_paro.strategy.options import GatherMode
    from lightning_paro.strategy.units import Unit


class ShardedEvaluation:
    """The rounds of one sharded evaluation stage of ``engine`` (collective over its P scope).

    Args:
        engine: the engine, with its root unit gathered for the stage.
        sequence: the units, in the order the last training forward used them (the agreed order of gathers until a
            step every rank runs says otherwise).
    """

    def __init__(self, engine: PaROEngine, sequence: list[Unit]) -> None:
        self.engine = engine
        self.sequence = [u for u in sequence if u.sharded_params]
        """The gathers a rank that ran out of batches replays: those of the latest step every rank ran."""
        self.step: list[Unit] | None = None
        """The sharded units the current step has used, in order (None between steps)."""
        self.tail = False
        """Whether, in this step's round, a peer had already run its last step."""
        self.joined = False
        """Whether this rank has served its peers until the last round."""

    @property
    def scope(self) -> str:
        return SCOPE_OF[self.engine.spec.params]

    @property
    def scope_size(self) -> int:
        topo = self.engine.comm.topology
        return topo.world_size if self.engine.spec.params == Level.G else topo.group_size

    def step_begin(self) -> None:
        """Before a step: this rank's round, flag 1 (running)."""
        running = self._round(running=True)
        self.tail = running < self.scope_size
        self.step = []

    def step_end(self, last: bool) -> None:
        """After a step; ``last``: this rank has no more batches in this stage, so it serves its peers' gathers until
        every rank has run its last step."""
        if self.step is None:
            return
        done, self.step = self.step, None
        if self.tail:
            # Peers that finished replay the whole agreed sequence: issue the gathers this step did not use.
            self._replay(self.sequence[len(done):])
        elif done:
            self.sequence = done
        for unit in self.engine.units[:-1]:  # a prefetched unit the step did not use
            unit.free()
        if last:
            self.join()

    def join(self) -> None:
        """Serve the peers' gathers until every rank of the P scope has run its last step (collective)."""
        if self.joined:
            return
        while self._round(running=False) > 0:
            self._replay(self.sequence)
        self.joined = True

    def enter(self, unit: Unit) -> None:
        """A unit's forward starts: check it against the agreed order, gather it, prefetch the next ones."""
        step, prefetch = self.step, self.engine.prefetch
        pos = len(step) if step is not None else -1
        in_sequence = 0 <= pos < len(self.sequence) and self.sequence[pos] is unit
        if step is not None:
            if self.tail and unit.sharded_params and not in_sequence:
                raise RuntimeError(
                    f"Sharded evaluation: this step used unit {unit.name!r} as its gather number {pos + 1}, where the"
                    f" ranks that have run out of batches replay {len(self.sequence)} gathers in the order of the last"
                    " step every rank ran. Every evaluation step must use the model's units in the same order; or"
                    " gather the model in full for evaluation (PaROStrategy(gather='full')).")
            if unit.sharded_params:
                step.append(unit)
        unit.ensure_ready()
        if in_sequence:
            for nxt in self.sequence[pos + 1:pos + 1 + prefetch]:
                nxt.gather(async_op=True)

    def _replay(self, units: list[Unit]) -> None:
        """The gathers and frees a step over ``units`` issues, in the same order, without computing."""
        prefetch = self.engine.prefetch
        for pos, unit in enumerate(units):
            unit.ensure_ready()
            for nxt in units[pos + 1:pos + 1 + prefetch]:
                nxt.gather(async_op=True)
            unit.free()

    def _round(self, running: bool) -> int:
        engine = self.engine
        engine.eval_rounds += 1
        flag = torch.full((1,), int(running), dtype=torch.int32, device=engine.control_device())
        engine.comm.scalar_all_reduce(flag, self.scope)
        return int(flag.item())


def gather_in_full(mode: GatherMode, sharded: bool, full_bytes: int, memory_fraction: float,
                   free_bytes: Callable[[], float]) -> bool:
    """Whether a stage holds the whole model: always when no parameter is ``sharded`` (both ways are the same), as
    ``mode`` says under "full" and "sharded", and under "auto" when the ``full_bytes`` of every parameter gathered
    fit ``memory_fraction`` of ``free_bytes()`` (called only then: it may be a collective)."""
    if not sharded:
        return True
    if mode != "auto":
        return mode != "sharded"
    return full_bytes <= memory_fraction * free_bytes()


def begin_stage(engine: PaROEngine, in_full: Callable[[], bool]) -> None:
    """Begin an evaluation stage: the whole model gathered when ``in_full()`` (no collective per batch), else
    sharded evaluation's rounds."""
    if in_full():
        engine.materialize()
    else:
        engine.begin_eval()


def run_step(engine: Optional[PaROEngine], step: Callable[..., Any], last_batch: Callable[[], bool], *args: Any,
             **kwargs: Any) -> Any:
    """Run an evaluation ``step``; under sharded evaluation inside its round, after which ``last_batch()`` says
    whether this rank has run its last batch of the stage."""
    if engine is None or engine.mode is not Mode.EVAL:
        return step(*args, **kwargs)
    engine.eval_step_begin()
    out = step(*args, **kwargs)
    engine.eval_step_end(last=last_batch())
    return out


def is_last_batch(module: Optional[pl.LightningModule]) -> bool:
    """Whether the batch just run is this rank's last of the stage (Lightning knows it one batch ahead; with a
    ``dataloader_iter`` step it does not, and the rank joins at the end of the stage instead)."""
    trainer = module._trainer if module is not None else None
    loop = getattr(trainer, "_active_loop", None)
    progress = getattr(loop, "batch_progress", None)
    return bool(getattr(progress, "is_last_batch", False))
