"""Train the demo GPT (tiny shape) under one PaRO strategy with several communication dtypes, in the same processes;
save each run's per-step losses, its traffic per optimizer step and its weights after fit.

argv: output directory, steps, then runs as ``NAME~PARAM+REDUCE[+QUANT][:STEPS:check]`` (``-``: the option left
unset; QUANT is ``inter_quant``, ``int8ef`` with error feedback), e.g. ``IIG~-+-`` (exact), ``IIG~bf16+bf16`` and
``IIG~-+-+int8``. ``:STEPS:check`` trains that many steps with a validation and a sharded
checkpoint in the middle, and records whether the checkpoint's weights are the optimizer's fp32 masters.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_paro  # noqa: F401
from lightning_paro import PaROStrategy
from lightning_paro.demo import StdlibData
from lightning_paro.demo.task import GPTTask
from lightning_paro.strategy.checkpoint import read_full

out_dir, steps, runs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class Record(L.Callback):
    """Per optimizer step: the loss averaged over the ranks (every rank sees it), and the traffic."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean")
        self.losses.append(loss.item())


class CheckMidFit(L.Callback):
    """Halfway: a sharded checkpoint while the parameters are the rounded copies; its weights against the masters."""

    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path, self.result = at, path, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.at:
            return
        engine = trainer.strategy.engine
        flats = [f for f in engine.flat_groups() if f.trainable]
        self.result["rounded_before_save"] = [not f.params_exact for f in flats]
        trainer.save_checkpoint(self.path)
        trainer.strategy.barrier()
        saved = read_full(self.path)["state_dict"]
        same = []
        for f in flats:
            flat = torch.zeros(f.layout.padded)
            for slot in f.slots:
                flat[slot.offset:slot.offset + slot.numel] = saved[slot.name].reshape(-1)
            o0, o1 = f.layout.range(f.spec.optim)
            same.append(torch.equal(flat[o0:o1], f.master.detach()))
        self.result["checkpoint_is_master"] = same


for run in runs:
    run_spec, _, check = run.partition(":")
    name, _, dtypes = run_spec.partition("~")
    param, _, reduce = dtypes.partition("+")
    reduce, _, quant = reduce.partition("+")
    run_steps, _, check = check.partition(":")
    run_steps = int(run_steps) if run_steps else steps
    L.seed_everything(0, verbose=False)
    model = GPTTask(seq_len=32, dim=32, heads=2, layers=2, lr=3e-3)
    data = StdlibData(seq_len=32, train_bytes=40_000, held_out_bytes=20_000, batch_size=4)
    strategy = PaROStrategy(sharding=name, group_size=2, param_dtype=None if param in ("", "-") else param,
                            reduce_dtype=None if reduce in ("", "-") else reduce,
                            inter_quant=None if quant in ("", "-") else "int8", error_feedback=quant == "int8ef")
    record = Record()
    callbacks = [record]
    if check:
        callbacks.append(mid := CheckMidFit(run_steps // 2, out_dir / f"{name}.ckpt"))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=run_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=2 if check else 0,
                        val_check_interval=run_steps // 2 if check else None, gradient_clip_val=1.0,
                        callbacks=callbacks)
    trainer.fit(model, datamodule=data)
    traffic = [{"intra": t.intra, "inter": t.inter, "by_op": t.by_op} for t in strategy.traffic_history]
    flats = [{"root": u is strategy.engine.root, "trainable": f.trainable, "padded": f.layout.padded,
              "elsize": f.p_local.element_size(), "error_feedback": f.quant_error is not None}
             for u in strategy.engine.units for f in u.flats]
    result = {"losses": record.losses, "traffic": traffic, "flats": flats,
              "val_loss": trainer.callback_metrics.get("val_loss", torch.tensor(float("nan"))).item()}
    if check:
        result.update(mid.result)
    (out_dir / f"{run}.{rank}.json").write_text(json.dumps(result))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out_dir / f"{run}.{rank}.pt")
print("done", rank)
