"""Run a list of fit jobs (JSON) in the same processes: each may resume from a checkpoint and save one.

Usage: ckpt_jobs.py OUT_DIR JOBS_JSON. A job: {"id", "strategy" ("ddp" or a PaRO strategy), "group_size",
"epochs", "resume" (path or null), "save" (path or null), "state_dict_type", "seed", "expect_error"}, or
{"convert": [sharded_dir, full_file]} (rank 0 consolidates, the others wait). Per job and rank, the losses go to
OUT_DIR/ID.RANK.json and, on rank 0, the final weights to OUT_DIR/ID.pt; an expected error's message goes to the
JSON instead.
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from tiny_lm import TinyLM, loader  # noqa: E402

import lightning_paro  # noqa: E402,F401
from lightning_paro import PaROStrategy  # noqa: E402

out = Path(sys.argv[1])
jobs = json.loads(Path(sys.argv[2]).read_text())
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ACC, STEPS_PER_EPOCH, BS = 2, 3, 2

import torch.distributed as dist  # noqa: E402

from lightning_paro.strategy.checkpoint import convert_to_full  # noqa: E402

for job in jobs:
    if "damage" in job:  # copy a sharded checkpoint and cut one of its data files in half
        if rank == 0:
            import shutil

            src, dst = map(Path, job["damage"])
            shutil.copytree(src, dst)
            victim = dst / "__1_0.distcp"
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        if dist.is_initialized():
            dist.barrier()
        continue
    if "convert" in job:
        if rank == 0:
            convert_to_full(*job["convert"])
        if dist.is_initialized():
            dist.barrier()
        continue
    torch.manual_seed(job.get("seed", 0))
    model = TinyLM(**job.get("model", {}))
    if job["strategy"] == "ddp":
        strategy = "ddp_find_unused_parameters_true"
    else:
        strategy = PaROStrategy(sharding=job["strategy"], group_size=job.get("group_size", 2),
                                state_dict_type=job.get("state_dict_type", "sharded"))
    callbacks = []
    if job.get("model_checkpoint"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=job["model_checkpoint"], save_top_k=1,
                                                             monitor="step", mode="max", every_n_epochs=1))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=job["epochs"],
                        callbacks=callbacks, enable_checkpointing=bool(callbacks),
                        accumulate_grad_batches=ACC, gradient_clip_val=1.0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    try:
        trainer.fit(model, loader(world * BS * ACC * STEPS_PER_EPOCH), ckpt_path=job.get("resume"))
    except Exception as err:  # noqa: BLE001
        if not job.get("expect_error"):
            raise
        (out / f"{job['id']}.{rank}.json").write_text(json.dumps({"error": f"{type(err).__name__}: {err}"}))
        continue
    if job.get("save"):
        trainer.save_checkpoint(job["save"])
    # Threads alive after the job (the operating system's count: gloo's threads for each process group are not Python
    # threads): a strategy that leaked its process groups or communication threads would grow it.
    (out / f"{job['id']}.{rank}.json").write_text(json.dumps({"losses": model.losses,
                                                              "global_step": trainer.global_step,
                                                              "threads": len(os.listdir("/proc/self/task"))}))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{job['id']}.pt")
print("done", rank)
