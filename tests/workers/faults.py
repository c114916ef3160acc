"""Fit the tiny LM on 4 processes (2 groups of 2) and break one rank at one step.

Usage: faults.py FAULT SHARDING FAULT_RANK FAULT_STEP TIMEOUT_S

FAULT is one of
  raise-flat   the flat all-gather (compat.all_gather_single, an intra-group gather) raises on FAULT_RANK
  raise-send   torch.distributed.isend (HO-Ring's point-to-point sends) raises on FAULT_RANK
  kill         FAULT_RANK kills itself with SIGKILL from a backward hook
  hang         FAULT_RANK sleeps forever in its training step (stops issuing collectives)
  none         no fault (the fit must finish)

The faulting rank prints "FAULT <unix time>" just before the fault. A fit that ends prints "FIT FINISHED"; a fit that
raises leaves Python's traceback (exit code 1).
"""

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from tiny_lm import TinyLM, loader  # noqa: E402

from lightning_paro import PaROStrategy, compat  # noqa: E402

fault, sharding, fault_rank, fault_step, timeout_s = sys.argv[1:6]
fault_rank, fault_step, timeout_s = int(fault_rank), int(fault_step), float(timeout_s)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
mine = rank == fault_rank and fault != "none"
armed = False


def announce() -> None:
    print(f"FAULT {time.time():.3f} rank {rank} {fault}", flush=True)


def injected(what: str):
    def fail(*args, **kwargs):
        if armed:
            announce()
            raise RuntimeError(f"injected fault in {what}")
        return original[what](*args, **kwargs)
    return fail


original = {"all_gather_single": compat.all_gather_single, "isend": dist.isend}
if mine and fault == "raise-flat":
    compat.all_gather_single = injected("all_gather_single")
if mine and fault == "raise-send":
    dist.isend = injected("isend")


class Faulty(TinyLM):
    def training_step(self, batch, batch_idx):
        global armed
        if mine and batch_idx == fault_step:
            armed = True
            if fault == "hang":
                announce()
                time.sleep(10**6)
        return super().training_step(batch, batch_idx)


def kill_in_backward(grad: torch.Tensor) -> None:
    if armed:
        announce()
        os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
model = Faulty()
if mine and fault == "kill":
    model.blocks[2].fc1.weight.register_hook(kill_in_backward)
strategy = PaROStrategy(sharding=sharding, group_size=2, timeout=timedelta(seconds=timeout_s))
trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=fault_step + 3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_val_batches=0, gradient_clip_val=1.0)
trainer.fit(model, loader(world * 2 * (fault_step + 3)))
print("FIT FINISHED", flush=True)
