"""The modes of a :class:`~lightning_paro.strategy.engine.PaROEngine` and its evaluation stages:
:class:`EvaluationStages` owns the engine's mode, the exact weights evaluation and export read, and each stage's
rounds; :class:`ShardedEvaluation` keeps one sharded stage's rounds.

Training may gather parameters rounded on the wire (``comm_dtypes``); evaluation reads exact weights: the parameter
storage is made exact first, and gathers outside training travel in the parameters' own dtype. A stage holds the
whole model (mode FULL: every unit gathered, no collective per batch) or runs sharded (mode EVAL).

**Sharded evaluation.** Lightning's predict sampler does not pad, so ranks may run different numbers of steps, but
every gather is a collective over the P scope. So evaluation goes in rounds, one per step: each rank first adds a
"still running" flag into one scalar all-reduce over that scope. While every rank runs, each gathers the units its
forward uses (prefetching in the order of the last step every rank ran). A rank that has run its last step keeps
taking part in the rounds with a 0 and serves its peers until a round counts no rank running. In a round where a
peer has finished (a tail round), the running ranks announce each sharded unit before gathering it (one more scalar
all-reduce of the unit's index), and the finished ranks gather what is announced, until the running ranks announce
the end of their step: the gathers follow the order the running ranks use, whatever order any earlier step or the
registration had. Running ranks that use different units at the same point of a tail round fail, naming the unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch

from lightning_paro.comm.collectives import Communicator
from lightning_paro.strategy.levels import Level
from lightning_paro.strategy.modes import Mode
from lightning_paro.strategy.transitions import SCOPE_OF
from lightning_paro.strategy.units import Unit, wait_all


class EvaluationStages:
    """The mode of one engine's units and the evaluation stages run on them.

    Args:
        units: the engine's units, the root unit last.
        comm: the communicator.
        params_level: the P level (the scope of sharded evaluation's rounds and gathers).
        prefetch: how many units ahead a sharded stage gathers.
        control_device: where control tensors (round flags) live.
    """

    def __init__(self, units: list[Unit], comm: Communicator, params_level: Level, prefetch: int,
                 control_device: Callable[[], torch.device]) -> None:
        self.units = units
        self.root = units[-1]
        self.comm = comm
        self.params_level = params_level
        self.prefetch = max(0, int(prefetch))
        self.control_device = control_device
        self._mode = Mode.SHARDED
        self.current: ShardedEvaluation | None = None
        """The rounds of the sharded evaluation stage in progress (mode EVAL)."""
        self.rounds = 0
        """Rounds of sharded evaluation this rank took part in (one scalar all-reduce each)."""

    # ------------------------------------------------------------------ mode and exact weights
    @property
    def mode(self) -> Mode:
        """Training (SHARDED) or one of the evaluation modes; only training gathers in ``comm_dtypes``."""
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        self._mode = mode
        self._set_exact_gathers(mode is not Mode.SHARDED)

    def _set_exact_gathers(self, exact: bool) -> None:
        for unit in self.units:
            for f in unit.flats:
                f.exact_gathers = exact

    @contextmanager
    def exact_gathers(self) -> Iterator[None]:
        """Gathers in the parameters' own dtype inside the block, whatever the mode; after it, as the mode says."""
        self._set_exact_gathers(True)
        try:
            yield
        finally:
            self._set_exact_gathers(self._mode is not Mode.SHARDED)

    def exact_params(self) -> None:
        """Collective. Drop gathered units rounded on the wire and run the OS -> P sync again in the parameters' own
        dtype (nothing to do where training left the storage exact)."""
        for unit in self.units:
            if any(f.gathered_rounded for f in unit.flats):
                unit.free()
        for unit in self.units:
            for f in unit.flats:
                if f.trainable:
                    f.exact_params()

    # ------------------------------------------------------------------ stages
    def materialize(self) -> None:
        """Gather every unit, exact, and keep it gathered (mode FULL): no collectives per batch."""
        self.exact_params()
        with self.exact_gathers():
            for unit in self.units:
                unit.wait_param_sync()
                unit.gather(async_op=True)
            for unit in self.units:
                unit.wait_gather()
        self.mode = Mode.FULL

    def release(self) -> None:
        """Free what is sharded; back to training mode."""
        for unit in self.units:
            if unit.sharded_params:
                unit.free()
        self.mode = Mode.SHARDED
        self.current = None

    def begin_eval(self, order: list[Unit]) -> None:
        """Start a sharded evaluation stage: the root unit gathered (exact) for the stage; ``order`` is the last
        training forward's order of units (the prefetch's order until a step every rank runs says otherwise). With
        P = N, :meth:`materialize`."""
        if not self.root.sharded_params:
            self.materialize()
            return
        wait_all(self.units)
        self.release()
        self.exact_params()
        with self.exact_gathers():
            self.root.ensure_ready()
        self.current = ShardedEvaluation(self, [u for u in order if u is not self.root] or self.units[:-1])
        self.mode = Mode.EVAL

    def step_begin(self) -> None:
        if self._mode is Mode.EVAL:
            self.current.step_begin()

    def step_end(self, last: bool) -> None:
        if self._mode is Mode.EVAL:
            self.current.step_end(last)

    def join(self) -> None:
        if self._mode is Mode.EVAL:
            self.current.join()

    def end_eval(self) -> None:
        """End of an evaluation stage: join if the last step did not, then free what is sharded."""
        if self._mode is Mode.EVAL:
            self.current.join()
        if self._mode in (Mode.EVAL, Mode.FULL):
            self.release()

    def enter(self, unit: Unit) -> None:
        """A unit's forward starts under sharded evaluation."""
        self.current.enter(unit)

    def leave(self, unit: Unit) -> None:
        """A unit's forward ended under sharded evaluation: free it."""
        unit.free()

    def after_load(self) -> None:
        """New weights were written into the shards (gathered copies dropped): gather again what the mode keeps."""
        if self._mode is Mode.FULL:
            self.materialize()
        elif self._mode is Mode.EVAL:
            self.root.ensure_ready()

    # ------------------------------------------------------------------ the scope of the rounds
    @property
    def scope(self) -> str:
        return SCOPE_OF[self.params_level]

    @property
    def scope_size(self) -> int:
        topo = self.comm.topology
        return topo.world_size if self.params_level == Level.G else topo.group_size

    def all_reduce_control(self, values: list[int]) -> list[int]:
        """Sum small integers over the scope of the rounds (one scalar all-reduce)."""
        flag = torch.tensor(values, dtype=torch.int64, device=self.control_device())
        self.comm.scalar_all_reduce(flag, self.scope)
        return [int(v) for v in flag.tolist()]


_END = 0
"""The announcement that ends a step's gathers in a tail round (unit k is announced as k + 1)."""


class ShardedEvaluation:
    """The rounds of one sharded evaluation stage (collective over the P scope).

    Args:
        stages: the engine's stages, with the root unit gathered for this one.
        sequence: the units in the order the last training forward used them: the prefetch's order until a step every
            rank runs says otherwise.
    """

    def __init__(self, stages: EvaluationStages, sequence: list[Unit]) -> None:
        self.stages = stages
        self.sequence = [u for u in sequence if u.sharded_params]
        """The order the prefetch follows in rounds where every rank runs: that of the latest such step."""
        self.announced = [u for u in stages.units[:-1] if u.sharded_params]
        """The units a tail round may announce, by index (the same list on every rank)."""
        self.step: list[Unit] | None = None
        """The sharded units the current step has used, in order (None between steps)."""
        self.tail = False
        """Whether, in this step's round, a peer had already run its last step."""
        self.joined = False
        """Whether this rank has served its peers until the last round."""

    def step_begin(self) -> None:
        """Before a step: this rank's round, flag 1 (running)."""
        running = self._round(running=True)
        self.tail = running < self.stages.scope_size
        self.step = []

    def step_end(self, last: bool) -> None:
        """After a step; ``last``: this rank has no more batches in this stage, so it serves its peers' gathers until
        every rank has run its last step."""
        if self.step is None:
            return
        done, self.step = self.step, None
        if self.tail:
            self._announce(_END)
        elif done:
            self.sequence = done
        for unit in self.stages.units[:-1]:  # a prefetched unit the step did not use
            unit.free()
        if last:
            self.join()

    def join(self) -> None:
        """Serve the peers' gathers until every rank of the P scope has run its last step (collective)."""
        if self.joined:
            return
        while self._round(running=False) > 0:
            self._serve_step()
        self.joined = True

    def enter(self, unit: Unit) -> None:
        """A unit's forward starts: gather it (announcing it first in a tail round), prefetch the next ones."""
        step = self.step
        if step is not None and unit.sharded_params:
            step.append(unit)
            if self.tail:
                self._announce(self.announced.index(unit) + 1, unit)
                unit.ensure_ready()
                return
        unit.ensure_ready()
        pos = len(step) - 1 if step is not None else -1
        if 0 <= pos < len(self.sequence) and self.sequence[pos] is unit:
            for nxt in self.sequence[pos + 1:pos + 1 + self.stages.prefetch]:
                nxt.gather(async_op=True)

    def _serve_step(self) -> None:
        """A finished rank's part of a tail round: gather each unit the running ranks announce, until they end."""
        while True:
            index = self._announce(None)
            if index == _END:
                return
            unit = self.announced[index - 1]
            unit.ensure_ready()
            unit.free()

    def _announce(self, index: int | None, unit: Unit | None = None) -> int:
        """One announcement of a tail round: running ranks pass the unit's ``index`` (or :data:`_END`), finished ranks
        None; returns what the running ranks announced, which must agree."""
        mine = [0, 0, 0] if index is None else [1, index, index * index]
        count, total, squares = self.stages.all_reduce_control(mine)
        if count == 0 or total * total != count * squares:
            what = f"unit {unit.name!r}" if unit is not None else "the end of its step"
            raise RuntimeError(
                f"Sharded evaluation: in a round where a peer had run its last batch, the ranks still running did not"
                f" use the same unit at the same point of their step (this rank: {what}). Every evaluation step must"
                " use the model's units in the same order on every rank; or gather the model in full for evaluation"
                " (PaROStrategy(gather='full')).")
        return total // count

    def _round(self, running: bool) -> int:
        self.stages.rounds += 1
        (count,) = self.stages.all_reduce_control([int(running)])
        return count
