"""Fit, validate, test and predict with the PaRO strategy under one of Lightning's ways to launch.

Usage: launch_modes.py MODE OUT_DIR, MODE in popen | spawn | torchrun | multinode. Evaluation data is uneven
across ranks on purpose (rank r runs 2 + r batches): sharded parameters must not make a rank wait for peers.
Under spawn every stage starts new workers (each importing torch and Lightning again): that mode runs fit and predict
only, the first stage and a later one that gets the module the parent recovered from fit's workers; validate and test
take the same path as predict and run under the other modes.
"""

import json
import sys
from pathlib import Path

import torch
import torchmetrics

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from tiny_lm import VOCAB, TinyLM, token_data  # noqa: E402

import lightning_paro  # noqa: E402,F401
from lightning_paro import PaROStrategy  # noqa: E402


class LM(TinyLM):
    def __init__(self):
        super().__init__(freeze_block=None, unused=False)
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB)
        self.eval_batches = 0

    def validation_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self(idx[:, :-1])
        self.acc(logits.argmax(-1).reshape(-1), idx[:, 1:].reshape(-1))
        self.log("val_acc", self.acc, sync_dist=True)
        self.log("val_loss", self.loss(batch), sync_dist=True)
        self.eval_batches += 1

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)
        self.eval_batches += 1


class Recorder(L.Callback):
    """Writes what each stage saw into OUT/MODE.RANK.json, from inside the worker processes (spawn starts new
    workers for every stage, so nothing can be collected in the parent)."""

    def __init__(self, mode: str, out: Path):
        self.mode, self.out = mode, out

    def _update(self, trainer, **facts):
        path = self.out / f"{self.mode}.{trainer.global_rank}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update(facts)
        path.write_text(json.dumps(data))

    def on_fit_end(self, trainer, pl_module):
        s = trainer.strategy
        self._update(trainer, world=s.world_size, group_size=s.group_size, num_groups=s.topology.num_groups,
                     sharding=s.sharding.name, losses=pl_module.losses, steps_logged=len(s.traffic_history))

    def on_validation_start(self, trainer, pl_module):
        pl_module.eval_batches = 0

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.state.fn == "validate":
            self._update(trainer, val_batches=pl_module.eval_batches,
                         val_acc=float(trainer.callback_metrics["val_acc"]))

    def on_test_start(self, trainer, pl_module):
        pl_module.eval_batches = 0

    def on_test_end(self, trainer, pl_module):
        self._update(trainer, test_batches=pl_module.eval_batches)

    def on_predict_start(self, trainer, pl_module):
        self.predicted = 0

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        assert outputs.shape == batch[0][:, :-1].shape
        self.predicted += 1

    def on_predict_end(self, trainer, pl_module):
        checksum = sum(float(p.detach().double().sum()) for p in pl_module.parameters())
        self._update(trainer, checksum=checksum, predict_batches=self.predicted)


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    kwargs = dict(accelerator="cpu", devices=2, max_steps=3, accumulate_grad_batches=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  use_distributed_sampler=False, num_sanity_val_steps=1, callbacks=[Recorder(mode, out)])
    if mode == "popen":
        strategy = "paro_nig"
        kwargs["logger"] = L.pytorch.loggers.CSVLogger(out, name="logs", version=0)
        kwargs["log_every_n_steps"] = 1
    elif mode == "spawn":
        strategy = PaROStrategy(sharding="IGG", start_method="spawn")
    elif mode == "torchrun":
        strategy = "paro_ggg"
    elif mode == "multinode":
        strategy = "paro_iig"
        kwargs["num_nodes"] = 2
    else:
        raise SystemExit(f"unknown mode {mode}")
    torch.manual_seed(0)
    model = LM()
    trainer = L.Trainer(strategy=strategy, **kwargs)
    trainer.fit(model, data(6), data(4, 2))  # evaluation: rank r reads 2 + r batches
    if mode != "spawn":
        trainer.validate(model, data(4, 2), verbose=False)
        trainer.test(model, data(4, 2), verbose=False)
    trainer.predict(model, data(2, 2))  # rank r predicts 1 + r batches


class RankData(torch.utils.data.Dataset):
    """Token rows whose number depends on the rank of the process reading them (decided lazily, in the worker)."""

    def __init__(self, base: int, per_rank: int = 0):
        self.base, self.per_rank = base, per_rank

    def _rows(self):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        n = self.base + self.per_rank * rank
        return token_data(n, seed=100 + rank).tensors[0]

    def __len__(self):
        return len(self._rows())

    def __getitem__(self, i):
        return (self._rows()[i],)


def data(base, per_rank=0):
    return torch.utils.data.DataLoader(RankData(base, per_rank), batch_size=2)


if __name__ == "__main__":
    main()
