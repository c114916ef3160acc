"""Train the tiny LM with "ddp" and with PaRO strategies in the same processes; save losses, weights, traffic."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from package_warnings import package_deprecations  # noqa: E402
from tiny_lm import TinyLM, loader  # noqa: E402

import lightning_paro  # noqa: E402,F401
from lightning_paro import PaROStrategy  # noqa: E402

out_dir = Path(sys.argv[1])
strategies = sys.argv[2].split(",")
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
ACC, STEPS, BS = 2, 6, 2


class Probe(L.Callback):
    """Capture engine facts before teardown gives the module back, and the traffic of every micro-step."""

    def __init__(self):
        self.micro = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = trainer.strategy
        if isinstance(s, PaROStrategy):
            self.micro.append({k: v for k, v in s.meter.snapshot().items() if k[0] != "control"})

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy
        if isinstance(s, PaROStrategy):
            pl_module.probe = {
                "memory": s.memory_report(),
                "params": s.engine.num_params(),
                "flats": [
                    {"unit": u.name, "root": u is s.engine.root, "trainable": f.trainable, "padded": f.layout.padded,
                     "elsize": f.p_local.element_size()}
                    for u in s.engine.units for f in u.flats
                ],
                "traffic": [{"intra": t.intra, "inter": t.inter, "by_op": t.by_op} for t in s.traffic_history],
                "summary": s.summary(),
                "sharding": s.sharding.name,
                "auto_choice": s.auto_plan.choice if s.auto_plan is not None else None,
                "micro": [[[list(k), v] for k, v in snap.items()] for snap in self.micro],
            }


with package_deprecations() as deprecations:
    for spec in strategies:
        # NAME[@precision][#optimizer][%clip algorithm][~bf16 (parameters and gradients), int8 (between groups) or
        # int8ef (int8 with error feedback)]
        rest, _, comm_dtype = spec.partition("~")
        rest, _, clip = rest.partition("%")
        rest, _, optimizer = rest.partition("#")
        name, _, precision = rest.partition("@")
        precision = precision or "32-true"
        torch.manual_seed(1234)
        model = TinyLM(optimizer=optimizer or "adamw")
        dtype = comm_dtype if comm_dtype in ("bf16", "fp32") else None
        strategy = "ddp_find_unused_parameters_true" if name == "ddp" else PaROStrategy(
            sharding=name, group_size=2, param_dtype=dtype, reduce_dtype=dtype,
            inter_quant="int8" if comm_dtype.startswith("int8") else None, error_feedback=comm_dtype == "int8ef")
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS,
                            accumulate_grad_batches=ACC, gradient_clip_val=1.0 if clip != "value" else 0.05,
                            gradient_clip_algorithm=clip or "norm", precision=precision, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[probe := Probe()])
        trainer.fit(model, loader(world * BS * ACC * STEPS))
        result = {"losses": model.losses, "probe": getattr(model, "probe", None)}
        (out_dir / f"{spec}.{rank}.json").write_text(json.dumps(result))
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out_dir / f"{spec}.pt")
(out_dir / f"warnings.{rank}.json").write_text(json.dumps(deprecations))
print("done", rank)
