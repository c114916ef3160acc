"""Sharded evaluation of a model whose forward runs its blocks in another order than it registers them, with no
training forward before it and uneven steps (rank 0: 2, rank 1: none, so every round is a tail round): the outputs equal those of the whole model
gathered. Argument: the output directory; writes ``<rank>.json``."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from lightning_paro.comm.collectives import Communicator
from lightning_paro.comm.topology import Topology
from lightning_paro.strategy.engine import PaROEngine
from lightning_paro.strategy.levels import ShardingSpec


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class Reversed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = block(x)
        return self.head(x)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    try:
        torch.manual_seed(0)
        model = Reversed()
        engine = PaROEngine(model, ShardingSpec.parse("GGG"), Communicator(Topology.from_process_group()))
        batches = [torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * rank + k)) for k in range(2 if rank == 0 else 0)]
        with torch.no_grad():
            engine.begin_eval()
            got = []
            for k, x in enumerate(batches):
                engine.eval_step_begin()
                got.append(model(x))
                engine.eval_step_end(last=k == len(batches) - 1)
            engine.end_eval()
            engine.materialize()
            want = [model(x) for x in batches]
            engine.release()
        engine.wait()
        out["max_diff"] = max((float((a - b).abs().max()) for a, b in zip(got, want)), default=0.0)
        out["steps"] = len(got)
        out["rounds"] = engine.eval_rounds
    except Exception as exc:  # reported to the test, which names it
        out["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
