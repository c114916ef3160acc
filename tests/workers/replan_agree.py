"""Two processes re-plan with different steps left and different step times: every decision is rank 0's.

Each rank drives a ``JobReplanner`` by hand over a tiny model (NNG in use, NGG its only gradient-only neighbour,
trial and switch margins set so that the steps left alone decide whether a trial runs): rank 0's fit has 100 steps
left, rank 1's none (a dataloader of another length), and rank 1's steps take longer. It records each step's decision
and writes OUT/RANK.json.

argv: output directory.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_paro.planner import AutoConfig, Cluster, Compute, Link, Workload, plan
from lightning_paro.planner.job import JobReplanner

out = Path(sys.argv[1])
if not dist.is_initialized():  # run after Lightning fits in the same processes (auto_fits.py): their group
    dist.init_process_group("gloo")
rank = dist.get_rank()

work = Workload(num_params=1e8, num_trainable=1e8, accumulation=1, num_units=8, param_bytes=4, grad_bytes=4,
                optim_bytes=8, tokens_per_micro_batch=1024)
cluster = Cluster(8, 4, Link.gbit(100, 5), Link.gbit(1, 50), device_memory=4e9)
start = plan(work, cluster, Compute(None, memory_bandwidth=1e11), 0.9)
config = AutoConfig(strategies=("NNG", "NGG"), replan_after_steps=2, replan_margin=1e9, trial_margin=1e9)
planner = JobReplanner(config, start, "NNG", "cpu", waited=lambda: 0.0, traffic=lambda: (0.0, 0.0),
                       excluded_storages=set, steps_left=lambda: 100.0 if rank == 0 else 0.0)
model = nn.Linear(4, 4)
decisions = []
for step in range(8):
    with planner.forward():
        loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    planner.end_backward()
    time.sleep(0.01 * (1 + rank))
    decision = planner.end_step()
    decisions.append(None if decision is None else [decision.switch_to, decision.reason])
    if decision is not None and decision.switch_to is not None:
        planner.current = decision.switch_to  # what the strategy's switch sets
    if planner.finished:
        break
dist.barrier()
(out / f"{rank}.json").write_text(json.dumps({"decisions": decisions, "tried": planner.tried,
                                               "step_seconds": planner.figures.step_seconds}))
dist.destroy_process_group()
print("done", rank)
