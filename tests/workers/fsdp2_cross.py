"""Cross-resume between PaRO's sharded checkpoints and FSDP2's under Lightning's ``ModelParallelStrategy``.

Usage: fsdp2_cross.py OUT_DIR PHASES. The phases (:data:`PHASES`) run in order in the same processes, each with a new
Trainer and a freshly built model; a phase that resumes builds its model from another seed, so only the checkpoint
makes it continue like ``ddp``. Every global batch is the same at any world size (GLOBAL_BATCH samples in order,
split evenly across ranks, no shuffle); AdamW; fp32. The model is :class:`ShardableLM`, with or without TinyLM's
parameter that no step uses.

Per phase and rank the results go to OUT_DIR/PHASE.wWORLD.RANK.json: the losses, ``global_step``, the optimizer's
largest AdamW step count and how many parameters are DTensors; an error as ``{"error": ...}``, after which the phases
that resume from its checkpoint are skipped (``{"skipped": ...}``). ``{"started": true}`` is written when a phase
starts, so a phase that hangs or kills its process is named by the file it leaves.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from tiny_lm import TinyLM, loader  # noqa: E402

from lightning_paro import PaROStrategy  # noqa: E402

GLOBAL_BATCH, STEPS_PER_EPOCH = 8, 2
out = Path(sys.argv[1])
phases = sys.argv[2].split(",")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class ShardableLM(TinyLM):
    """TinyLM as FSDP2 users write it: under ``ModelParallelStrategy`` ``configure_model`` applies ``fully_shard`` to
    each block and then to the whole model over the data-parallel mesh; under any other strategy it does nothing."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(self.trainer.strategy, ModelParallelStrategy) or isinstance(self, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


PHASES = {
    # name: (strategy, epochs, model has TinyLM's unused parameter, checkpoint it resumes from or None, saves one)
    "ddp": ("ddp", 2, True, None, False),
    "paro_iig": ("IIG", 1, True, None, True),
    "mp_from_paro": ("fsdp2", 2, True, "paro_iig", False),
    "fsdp2": ("fsdp2", 1, False, None, True),
    "paro_ggg_from_fsdp2": ("GGG", 2, False, "fsdp2", False),
    "fsdp2_unused": ("fsdp2", 1, True, None, True),
    "paro_ggg_from_fsdp2_unused": ("GGG", 2, True, "fsdp2_unused", False),
}
"""One epoch is STEPS_PER_EPOCH optimizer steps; a checkpoint is saved after the first epoch and resumed for the
second, so no phase depends on how Lightning restarts inside an epoch."""


def strategy_of(name: str):
    if name == "ddp":
        return "ddp_find_unused_parameters_true"  # TinyLM has a parameter no step uses
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return PaROStrategy(sharding=name, group_size=2)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """The largest AdamW step count the optimizer holds: the steps it has taken, restored ones included."""
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(steps)) if steps else 0


def run(phase: str) -> dict:
    from torch.distributed.tensor import DTensor

    strategy, epochs, unused, resumes, saves = PHASES[phase]
    torch.manual_seed(9 if resumes else 1)
    model = ShardableLM(unused=unused)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy_of(strategy), max_epochs=epochs,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    data = loader(GLOBAL_BATCH * STEPS_PER_EPOCH, batch_size=GLOBAL_BATCH // world)
    trainer.fit(model, data, ckpt_path=str(out / f"{resumes}.ckpt") if resumes else None)
    if saves:
        trainer.save_checkpoint(out / f"{phase}.ckpt")
    return {"losses": model.losses, "global_step": trainer.global_step,
            "optimizer_steps": optimizer_steps(trainer.optimizers[0]),
            "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
            "params": sum(1 for _ in model.parameters())}


failed: set[str] = set()
for phase in phases:
    result_file = out / f"{phase}.w{world}.{rank}.json"
    needs = PHASES[phase][3]
    if needs in failed:
        result_file.write_text(json.dumps({"skipped": f"phase {needs!r}, whose checkpoint it resumes, failed"}))
        failed.add(phase)
        continue
    result_file.write_text(json.dumps({"started": True}))
    try:
        res = run(phase)
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        res = {"error": f"{type(err).__name__}: {err}"}
        failed.add(phase)
    result_file.write_text(json.dumps(res))
print("done", rank)
