"""How the strategy ends a stage: the module handed back gathered when it fits, else left sharded; and Lightning's
``Strategy.teardown`` without the steps that would read sharded storage or, after a failure, wait for peers.

Plain functions over the engine and the strategy's plugins; ``PaROStrategy.teardown`` picks among them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device

from lightning_paro.strategy.modes import Mode

if TYPE_CHECKING:
    from lightning.pytorch.strategies.strategy import Strategy

    from lightning_paro.strategy.engine import PaROEngine


def hand_back(engine: PaROEngine, in_full: Callable[[], bool]) -> bool:
    """Give the module back with every unit gathered when the engine already holds it whole or ``in_full()`` says it
    fits (its weights readable, as after "ddp"); otherwise release the gathered copies and leave it sharded. Returns
    whether it is whole. Left sharded, each parameter shows this rank's piece of it (readable memory,
    :meth:`PaROEngine.leave_sharded`). The shards (and optimizer states) stay in place for ``trainer.save_checkpoint``
    and the next stage either way."""
    engine.wait()
    if engine.mode is Mode.FULL or in_full():
        engine.materialize()
        return True
    engine.leave_sharded()
    return False


def teardown_sharded(strategy: Strategy) -> None:
    """Strategy.teardown without moving the module to the CPU: its parameters are sharded (a copy would read freed
    storage); it stays on its device, as the next stage needs it."""
    assert strategy.cluster_environment is not None and strategy.accelerator is not None
    strategy.cluster_environment.teardown()
    _optimizers_to_device(strategy.optimizers, torch.device("cpu"))
    strategy.precision_plugin.teardown()
    strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()


def teardown_after_failure(strategy: Strategy) -> None:
    """Strategy.teardown without what needs peers or intact shards: no collective (gathering the module waits for
    ranks that may be gone), and the module and optimizer states stay where they are (sharded parameters hold no
    storage to move). The process can then exit with the error."""
    assert strategy.cluster_environment is not None and strategy.accelerator is not None
    strategy.cluster_environment.teardown()
    strategy.precision_plugin.teardown()
    strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()
