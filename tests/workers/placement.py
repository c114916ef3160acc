"""Fit PaRO strategies under the collective audit (tests/collective_audit.py), each twice: HO-Ring on its phase
threads, then in single-thread mode. Writes OUT_DIR/<rank>.json: per strategy and mode, every torch.distributed call
(name, thread, tensor devices, count), the calls other threads issued while the communication thread was busy, the
losses, and whether the two modes gave the same losses and weights.

Usage: placement.py OUT_DIR STRATEGIES (comma-separated)
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from collective_audit import Recorder, allocate_on_meta_by_default  # noqa: E402

from lightning_paro.comm import collectives  # noqa: E402

workers = []  # every communication thread of this process
_start_worker = collectives._Worker.__init__


def _record_worker(self, *args, **kwargs):
    _start_worker(self, *args, **kwargs)
    workers.append(self)


collectives._Worker.__init__ = _record_worker
recorder = Recorder(torch.device("cpu"), busy=lambda: any(w.busy for w in workers)).install()
wrapped = allocate_on_meta_by_default()

import lightning as L  # noqa: E402
from tiny_lm import TinyLM, loader  # noqa: E402

import lightning_paro.strategy.strategy as strategy_module  # noqa: E402
from lightning_paro import PaROStrategy  # noqa: E402
from lightning_paro.comm.collectives import HOR_EXACT_SCOPES  # noqa: E402

out_dir, strategies = Path(sys.argv[1]), sys.argv[2].split(",")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
STEPS, BS = 3, 2
MODES = {"threads": False, "single": True}

report: dict = {"wrapped": len(wrapped), "runs": {}}
for spec in strategies:
    outcome = {}
    for mode, single_thread in MODES.items():
        # What the strategy hands its Communicator (chunk_bytes is applied on top of it).
        strategy_module.HOR_EXACT_SCOPES = dataclasses.replace(HOR_EXACT_SCOPES, single_thread=single_thread)
        recorder.reset()
        torch.manual_seed(1234)
        model = TinyLM()
        # Small chunks: every HO-Ring collective runs as a pipeline of many chunks, so the modes interleave differently.
        strategy = PaROStrategy(sharding=spec, group_size=2, chunk_bytes=256)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS,
                            gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=1)
        trainer.fit(model, loader(world * BS * STEPS), loader(world * BS, seed=1))
        outcome[mode] = {"losses": model.losses,
                         "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                         "calls": [[name, thread, list(devices), count]
                                   for (name, thread, devices), count in sorted(recorder.calls.items())],
                         "beside": [[name, thread, list(devices), count]
                                    for (name, thread, devices), count in sorted(recorder.beside.items())]}
    a, b = outcome["threads"], outcome["single"]
    report["runs"][spec] = {
        "same_losses": a["losses"] == b["losses"],
        "same_weights": a["weights"].keys() == b["weights"].keys() and all(
            torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]),
        "losses": a["losses"],
        "calls": {mode: outcome[mode]["calls"] for mode in MODES},
        "beside": {mode: outcome[mode]["beside"] for mode in MODES},
    }
(out_dir / f"{rank}.json").write_text(json.dumps(report))
print("done", rank)
