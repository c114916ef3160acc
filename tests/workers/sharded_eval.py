"""fit -> validate -> predict -> save -> export -> resume, under "ddp" and PaRO with evaluation gathered in full or
sharded, with uneven validation and predict batches across ranks.

Usage: sharded_eval.py OUT_DIR SYSTEMS. A system is "ddp" or "NAME-full" / "NAME-sharded" (a PaRO strategy with that
``gather`` mode, groups of 2). Under "NAME-sharded" the engine refuses any gather that would hold more than the root
unit and two other units' parameters at once (prefetch 1), which is below the full model. Per system and rank the
numbers go to OUT_DIR/SYSTEM.RANK.json, predictions to OUT_DIR/SYSTEM.preds.RANK.pt and, on rank 0, the exported
(PaRO) or final ("ddp") weights to OUT_DIR/SYSTEM.pt.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from tiny_lm import TinyLM, loader, token_data  # noqa: E402

from lightning_paro import PaROStrategy  # noqa: E402

out = Path(sys.argv[1])
systems = sys.argv[2].split(",")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
BS = 2


class UnevenSampler(DistributedSampler):
    """Every world-th sample from this rank's on, without the padding that evens the ranks out (Lightning keeps a
    DistributedSampler it is given)."""

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self):
        return len(range(self.rank, len(self.dataset), self.num_replicas))


def uneven(n: int, seed: int) -> DataLoader:
    data = token_data(n, seed)
    return DataLoader(data, batch_size=BS, sampler=UnevenSampler(data, num_replicas=world, rank=rank, shuffle=False))


class EvalLM(TinyLM):
    def predict_step(self, batch, batch_idx):
        return self(batch[0][:, :-1])


class Bounded(PaROStrategy):
    """Records the engine's gathered-bytes high-water mark and, with a ``limit``, makes the engine refuse a gather
    past it."""

    def __init__(self, *args, bounded: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.bounded = bounded

    def setup(self, trainer):
        super().setup(trainer)
        engine = self.engine
        if self.bounded and engine.gather_meter.limit is None:
            root = sum(f.full_bytes for f in engine.root.flats)
            unit = max(sum(f.full_bytes for f in u.flats) for u in engine.units[:-1])
            engine.gather_meter.limit = root + (1 + engine.prefetch) * unit


def strategy_of(system: str):
    if system == "ddp":
        return "ddp_find_unused_parameters_true"
    name, mode = system.split("-")
    return Bounded(sharding=name, group_size=2, gather=mode, bounded=mode == "sharded")


def trainer(system: str, **kwargs) -> L.Trainer:
    args = dict(accelerator="cpu", devices=world, strategy=strategy_of(system), logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0)
    args.update(kwargs)
    return L.Trainer(**args)


def memory(t: L.Trainer) -> dict:
    if not isinstance(t.strategy, PaROStrategy):
        return {}
    e = t.strategy.engine
    return {"peak": e.gather_meter.peak, "limit": e.gather_meter.limit, "full": e.full_param_bytes,
            "alive_after": e.gather_meter.alive, "rounds": e.eval_rounds}


def run(system: str) -> dict:
    d = out / system
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    model = EvalLM()
    t = trainer(system, max_steps=4, val_check_interval=2)
    # validation inside fit (after steps 2 and 4) on 9 samples: 2, 1, 1, 1 batches on the 4 ranks
    t.fit(model, loader(world * BS * 4), uneven(9, seed=1))
    res = {"losses": model.losses, "fit_val": float(t.callback_metrics["val_loss"]), "fit": memory(t)}
    # 11 samples: 2, 2, 2, 1 batches
    res["validate"] = float(t.validate(model, uneven(11, seed=2), verbose=False)[0]["val_loss"])
    res["validate_mem"] = memory(t)
    # Lightning's predict sampler does not pad: 11 samples give 3, 3, 3, 2 samples, i.e. 2, 2, 2, 1 batches
    preds = t.predict(model, loader(11, batch_size=BS, seed=3))
    torch.save([p.detach().clone() for p in preds], out / f"{system}.preds.{rank}.pt")
    res["predict_mem"] = memory(t)
    res["num_preds"] = len(preds)
    t.save_checkpoint(d / "ckpt")
    if isinstance(t.strategy, PaROStrategy):
        t.strategy.export_full_state_dict(out / f"{system}.pt")
    elif rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{system}.pt")
    res["save_mem"] = memory(t)
    if isinstance(t.strategy, PaROStrategy):  # left sharded or whole: what each parameter holds now, saved as it is
        torch.save(dict(model.named_parameters()), out / f"{system}.pieces.{rank}.pt")
    torch.manual_seed(9)
    resumed = EvalLM()
    t2 = trainer(system, max_steps=6, val_check_interval=2)
    t2.fit(resumed, loader(world * BS * 6), uneven(9, seed=1), ckpt_path=str(d / "ckpt"))
    res["resumed_losses"] = resumed.losses
    res["resumed_val"] = float(t2.callback_metrics["val_loss"])
    res["resume_mem"] = memory(t2)
    return res


for system in systems:
    try:
        res = run(system)
    except Exception as err:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        res = {"error": f"{type(err).__name__}: {err}"}
    (out / f"{system}.{rank}.json").write_text(json.dumps(res))
print("done", rank)
