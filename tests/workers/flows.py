"""Sequences of Trainer calls ("flows") under "ddp" and PaRO systems, all in the same processes.

Usage: flows.py OUT_DIR SYSTEMS [FLOWS]. A system is "ddp" or "NAME-sharded" / "NAME-full" (a PaRO strategy with that
checkpoint type, groups of 2), optionally with "-sharded" after it: evaluation and the module after fit stay sharded
(``gather="sharded"``), and the final weights are exported unit by unit. Every flow runs for every system in turn; per flow, system and rank the numbers go to
OUT_DIR/FLOW.SYSTEM.RANK.json and, on rank 0, the final weights to OUT_DIR/FLOW.SYSTEM.pt; checkpoints, logs and
predictions go under OUT_DIR/FLOW/SYSTEM/. A flow that raises records {"error": ...} and the next flow runs.
"""

import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from tiny_lm import BLOCKS, Block, TinyLM, loader  # noqa: E402

from lightning_paro import PaROStrategy  # noqa: E402
from lightning_paro.strategy.checkpoint import is_sharded_checkpoint  # noqa: E402
from lightning_paro.strategy.engine import _ENGINES, Mode  # noqa: E402

out = Path(sys.argv[1])
systems = sys.argv[2].split(",")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
BS = 2


def batches(steps: int, seed: int = 0):
    """A loader with ``steps`` batches per rank."""
    return loader(world * BS * steps, batch_size=BS, seed=seed)


class FlowLM(TinyLM):
    """The tiny LM with a test step, predictions as logits, and an LR schedule stepped per step or per epoch."""

    def __init__(self, interval: str = "step") -> None:
        super().__init__()
        self.interval = interval

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0][:, :-1])

    def configure_optimizers(self):
        conf = super().configure_optimizers()
        if self.interval == "epoch":
            sched = torch.optim.lr_scheduler.StepLR(conf["optimizer"], step_size=1, gamma=0.5)
            conf["lr_scheduler"] = {"scheduler": sched, "interval": "epoch"}
        return conf


class ConfigureModelLM(FlowLM):
    """The blocks are built in configure_model, which Lightning calls at every fit, validate, test and predict: it
    builds them once."""

    def __init__(self) -> None:
        super().__init__()
        del self.blocks

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        for p in self.blocks[1].parameters():
            p.requires_grad_(False)


class ManualLM(FlowLM):
    """Manual optimization: ``parts`` forwards and manual_backwards per batch, a clipped step every ``every``
    batches."""

    def __init__(self, parts: int, every: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.parts, self.every = parts, every

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        for part in batch[0].chunk(self.parts):
            loss = self.loss((part,)) / self.parts
            self.manual_backward(loss)
            self.losses.append(loss.item())
        if (batch_idx + 1) % self.every == 0:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched.step()


class BackwardAfterClipLM(ManualLM):
    """Manual optimization that clips between two manual_backwards of one step."""

    def __init__(self) -> None:
        super().__init__(parts=1, every=1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.loss(batch))
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.losses.append(loss.item())
        opt.step()
        opt.zero_grad()


class TwoOptimizersLM(FlowLM):
    """GAN-style: two optimizers stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.losses.append(loss.item())
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    def configure_optimizers(self):
        blocks = [p for p in self.blocks.parameters() if p.requires_grad]
        rest = [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("blocks.")]
        return [torch.optim.Adam(blocks, lr=self.lr), torch.optim.SGD(rest, lr=self.lr)]


def make_model(cls=FlowLM, seed: int = 1, **kwargs):
    torch.manual_seed(seed)
    return cls(**kwargs)


def strategy_of(system: str):
    if system == "ddp":
        return "ddp_find_unused_parameters_true"
    name, kind, *gather = system.split("-")
    return PaROStrategy(sharding=name, group_size=2, state_dict_type=kind, gather=gather[0] if gather else "auto")


def trainer(system: str, **kwargs) -> L.Trainer:
    args = dict(accelerator="cpu", devices=world, strategy=strategy_of(system), logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0)
    args.update(kwargs)
    return L.Trainer(**args)


def metrics(results: list) -> dict:
    return {k: float(v) for r in results for k, v in r.items()}


def save_weights(model, path: Path) -> None:
    engine = _ENGINES.get(id(model))
    if engine is not None and engine.module is model and engine.mode is not Mode.FULL and engine.root.sharded_params:
        state = engine.full_state_dict(rank0_only=True)  # left sharded after fit: its parameters hold no values
        if rank == 0:
            torch.save(state, path)
        return
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)


# ---------------------------------------------------------------------- flows: each returns the numbers to compare
def _fit_evaluate_save(system, d, stage: str, seed: int):
    model = make_model()
    t = trainer(system, max_steps=3)
    t.fit(model, batches(3))
    evaluate = t.validate if stage == "val" else t.test
    result = metrics(evaluate(model, batches(2, seed=seed), verbose=False))
    t.save_checkpoint(d / "ckpt")
    return model, {"losses": model.losses, stage: result, "ckpt": str(d / "ckpt")}


def fit_validate_save(system, d):
    return _fit_evaluate_save(system, d, "val", seed=1)


def fit_test_save(system, d):
    return _fit_evaluate_save(system, d, "test", seed=2)


def change_between_stages(system, d):
    """The module changes outside the Trainer between stages: its parameters get storage of their own (as moving it
    between devices does), then other weights are loaded into it; each stage and the checkpoint see the change."""
    if system.endswith("-sharded") and system.count("-") == 2:
        return None, {"skipped": "a module left sharded after fit has no parameter values to change"}
    model = make_model()
    t = trainer(system, max_steps=3)
    t.fit(model, batches(3))
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    val = metrics(t.validate(model, batches(2, seed=1), verbose=False))
    model.load_state_dict(make_model(seed=11).state_dict())
    test = metrics(t.test(model, batches(2, seed=2), verbose=False))
    t.save_checkpoint(d / "ckpt")
    return model, {"val": val, "test": test, "ckpt": str(d / "ckpt")}


def configure_model(system, d):
    """fit -> validate -> save_checkpoint -> fit again, with the layers built in configure_model."""
    model = make_model(ConfigureModelLM)
    t = trainer(system, max_steps=2)
    t.fit(model, batches(4))
    val = metrics(t.validate(model, batches(2, seed=1), verbose=False))
    t.save_checkpoint(d / "ckpt")
    t.fit_loop.epoch_loop.max_steps = 4
    t.fit(model, batches(4))
    return model, {"losses": model.losses, "val": val, "ckpt": str(d / "ckpt")}


def fit_predict_fit(system, d):
    model = make_model()
    t = trainer(system, max_steps=2)
    t.fit(model, batches(4))
    first = len(model.losses)
    preds = t.predict(model, batches(2, seed=3))
    torch.save([p.detach().clone() for p in preds], d / f"preds.{rank}.pt")
    t.fit_loop.epoch_loop.max_steps = 4  # the Trainer continues from step 2 with the fit's loop state
    t.fit(model, batches(4))
    return model, {"losses": model.losses, "first_fit": first, "global_step": t.global_step}


def eval_fresh(system, d):
    """validate and test alone, each on a fresh Trainer: initial weights, then the checkpoints the flows above
    saved (this system's own: sharded directory, full file, or "ddp"'s file)."""
    res = {}
    for stage, data_seed, ckpt_flow in (("validate", 1, "fit_validate_save"), ("test", 2, "fit_test_save")):
        for with_ckpt in (False, True):
            model = make_model(seed=5)
            t = trainer(system)
            ckpt = str(out / ckpt_flow / system / "ckpt") if with_ckpt else None
            fn = t.validate if stage == "validate" else t.test
            res[f"{stage}{'-ckpt' if with_ckpt else ''}"] = metrics(
                fn(model, batches(2, seed=data_seed), ckpt_path=ckpt, verbose=False))
    return None, res


def callbacks(system, d):
    """ModelCheckpoint (top-2 by val_loss, last, every 2 steps) and LearningRateMonitor into a CSV log; then
    validate(ckpt_path="best"), test(ckpt_path="last") and a new Trainer resuming fit from ckpt_path="last"."""
    model = make_model()
    mc = ModelCheckpoint(dirpath=d / "ckpts", filename="{step}", monitor="val_loss", save_top_k=2, save_last=True,
                         every_n_train_steps=2)
    t = trainer(system, max_steps=8, val_check_interval=2, limit_val_batches=2, log_every_n_steps=1,
                enable_checkpointing=True, callbacks=[mc, LearningRateMonitor(logging_interval="step")],
                logger=CSVLogger(d / "logs", name="", version=""))
    t.fit(model, batches(8), batches(2, seed=1))
    listing = sorted(p.name for p in (d / "ckpts").iterdir())
    kinds = {p.name: "sharded" if is_sharded_checkpoint(p) else "file" if p.is_file() else "?"
             for p in (d / "ckpts").iterdir()}
    res = {"losses": list(model.losses), "listing": listing, "kinds": kinds, "best": Path(mc.best_model_path).name,
           "best_score": float(mc.best_model_score), "last": Path(mc.last_model_path).name,
           "best_k": {Path(k).name: float(v) for k, v in mc.best_k_models.items()}}
    res["validate-best"] = metrics(t.validate(model, batches(2, seed=1), ckpt_path="best", verbose=False))
    res["test-last"] = metrics(t.test(model, batches(2, seed=2), ckpt_path="last", verbose=False))
    if rank == 0:
        with open(d / "logs" / "metrics.csv") as fh:
            rows = list(csv.DictReader(fh))
        res["lr"] = [{k: float(v) for k, v in row.items() if k.startswith("lr-") and v} for row in rows]
        res["lr"] = [row | {"step": int(r["step"])} for row, r in zip(res["lr"], rows) if row]
    resumed = make_model(seed=9)  # weights, optimizer and loops all come from the checkpoint
    t2 = trainer(system, max_steps=10, val_check_interval=2, limit_val_batches=2, enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=d / "ckpts", filename="{step}", monitor="val_loss", save_top_k=2,
                                            save_last=True, every_n_train_steps=2)])
    t2.fit(resumed, batches(8), batches(2, seed=1), ckpt_path="last")
    res["resumed_losses"] = resumed.losses
    res["resumed_global_step"] = t2.global_step
    return resumed, res


def early_stopping(system, d):
    model = make_model()
    t = trainer(system, max_steps=12, val_check_interval=2, limit_val_batches=2,
                callbacks=[EarlyStopping(monitor="val_loss", patience=1, min_delta=5.0)])
    t.fit(model, batches(12), batches(2, seed=1))
    return model, {"losses": model.losses, "global_step": t.global_step, "should_stop": bool(t.should_stop)}


def epoch_schedule(system, d):
    model = make_model(interval="epoch")
    t = trainer(system, max_epochs=2)
    t.fit(model, batches(2))
    return model, {"losses": model.losses, "lr": [g["lr"] for g in t.optimizers[0].param_groups],
                   "global_step": t.global_step}


def two_trainers(system, d):
    """One LightningModule fitted by two Trainers, one after the other."""
    model = make_model()
    trainer(system, max_steps=2).fit(model, batches(2))
    trainer(system, max_steps=2).fit(model, batches(2, seed=4))
    return model, {"losses": model.losses}


def sweep(system, d):
    """Fit after fit in one process: a new model, Trainer and strategy each time."""
    res = {}
    for seed in (2, 3):
        model = make_model(seed=seed)
        trainer(system, max_steps=2).fit(model, batches(2))
        res[f"losses{seed}"] = model.losses
    return model, res


def manual(system, d):
    """Two forwards and manual_backwards per batch, a clipped step per batch."""
    model = make_model(ManualLM, parts=2, every=1)
    trainer(system, max_steps=3).fit(model, batches(3))
    return model, {"losses": model.losses}


def manual_accumulate(system, d):
    """One manual_backward per batch, a clipped step every 2 batches."""
    model = make_model(ManualLM, parts=1, every=2)
    trainer(system, max_steps=2).fit(model, batches(4))
    return model, {"losses": model.losses}


def _fit_or_error(system, model):
    try:
        trainer(system, max_steps=2).fit(model, batches(2))
    except Exception as err:  # noqa: BLE001
        return None, {"raised": f"{type(err).__name__}: {err}", "losses": model.losses}
    return model, {"raised": None, "losses": model.losses}


def two_optimizers(system, d):
    return _fit_or_error(system, make_model(TwoOptimizersLM))


def backward_after_clip(system, d):
    return _fit_or_error(system, make_model(BackwardAfterClipLM))


FLOWS = [fit_validate_save, fit_test_save, change_between_stages, configure_model, fit_predict_fit, eval_fresh,
         callbacks, early_stopping, epoch_schedule, two_trainers, sweep, manual, manual_accumulate, two_optimizers,
         backward_after_clip]

only = sys.argv[3].split(",") if len(sys.argv) > 3 else None  # a subset of the flows, by name
timings = {}
for system in systems:
    for flow in FLOWS:
        if only is not None and flow.__name__ not in only:
            continue
        d = out / flow.__name__ / system
        d.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            model, res = flow(system, d)
        except Exception as err:  # noqa: BLE001
            model, res = None, {"error": f"{type(err).__name__}: {err}"}
        timings[f"{flow.__name__}.{system}"] = round(time.perf_counter() - start, 2)
        (out / f"{flow.__name__}.{system}.{rank}.json").write_text(json.dumps(res))
        if model is not None:
            save_weights(model, out / f"{flow.__name__}.{system}.pt")
(out / f"timings.{rank}.json").write_text(json.dumps(timings))
print("done", rank)
