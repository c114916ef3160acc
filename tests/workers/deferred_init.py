"""Deferred initialisation and sharded loading on 4 processes (GGG, 2 groups of 2).

Usage: deferred_init.py MODES OUT, MODES a comma-separated list of the parts below, run in order in one launch.
``values``: each model built on CPU and on the meta device from the same seed; the meta one sharded by the
engine; every rank checks the gathered values equal the CPU build's and that it holds only its shards.
``trainer``: the GPT built in ``configure_model`` on CPU and on the meta device trains to the same losses; the meta
one saves, validates and resumes; a fine-tuning run fills it from a safetensors file and a torch file."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning as L  # noqa: E402
from meta_models import GPTModule, GPTNet, TiedNorms, llama  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_paro import PaROStrategy  # noqa: E402
from lightning_paro.comm.collectives import Communicator  # noqa: E402
from lightning_paro.comm.topology import Topology  # noqa: E402
from lightning_paro.strategy.engine import PaROEngine  # noqa: E402
from lightning_paro.strategy.levels import ShardingSpec  # noqa: E402
from lightning_paro.strategy.loading import load_pretrained  # noqa: E402

modes, out = sys.argv[1].split(","), Path(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def values() -> dict:
    result: dict = {}
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    comm = Communicator(Topology(world_size=world, group_size=2, rank=rank), device=torch.device("cpu"))
    makers = {"gpt": lambda: GPTNet(vocab=40, dim=16, heads=2, layers=3, seq_len=8), "tied": TiedNorms,
              "llama": lambda: llama(False), "llama_tied": lambda: llama(True)}
    for name, make in makers.items():
        torch.manual_seed(7 + rank)  # rank 0's generator decides; the others must follow it
        if rank == 0:
            torch.manual_seed(7)
        cpu = make()
        reference = {k: v.clone() for k, v in cpu.state_dict().items()}
        torch.manual_seed(7 + rank)
        if rank == 0:
            torch.manual_seed(7)
        before = torch.get_rng_state()
        with torch.device("meta"):
            meta = make()
        first: dict[int, str] = {}
        ties = [[first[id(p)], n] for n, p in meta.named_parameters(remove_duplicate=False)
                if first.setdefault(id(p), n) != n]
        engine = PaROEngine(meta, ShardingSpec.parse("GGG"), comm)
        got = engine.full_state_dict()
        local = sum(f.p_local.numel() for f in engine.flat_groups())
        padded = sum(f.layout.padded for f in engine.flat_groups())
        reference = [reference[k] for k in got] if rank == 0 else None
        objs = [reference]
        torch.distributed.broadcast_object_list(objs, src=0)
        result[name] = {
            "equal": [bool(torch.equal(a, b.to(a.dtype))) for a, b in zip(objs[0], got.values())],
            "names": list(got),
            "ties": [[a, b, meta.get_parameter(a) is meta.get_parameter(b)] for a, b in ties],
            "local_over_padded": local / padded,
            "rng_untouched": bool(torch.equal(torch.get_rng_state(), before)),
            "buffers_on_cpu": all(b.device.type == "cpu" for b in meta.buffers()),
        }
        engine.restore_module()
    return result


def trainer_checks() -> dict:
    result: dict = {}

    def data(n: int) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 40, (n, 9), generator=g)), batch_size=2)

    class Check(L.Callback):
        """After set-up: the full weights (gathered) and this rank's parameter bytes."""

        def on_fit_start(self, trainer, pl_module):
            engine = trainer.strategy.engine
            pl_module.setup_values = {k: v.clone() for k, v in engine.full_state_dict().items()}
            pl_module.param_bytes = sum(f.p_local.numel() * f.p_local.element_size() for f in engine.flat_groups())

    def fit(model: GPTModule, steps: int, ckpt_path=None, save=None, validate=False):
        L.seed_everything(5, verbose=False)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=PaROStrategy(sharding="GGG", group_size=2),
                            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2,
                            callbacks=[Check()])
        # two batches per rank and epoch: the checkpoint after two steps ends an epoch, so resuming sees the same
        # batches as the uninterrupted run
        trainer.fit(model, data(world * 2 * 2), val_dataloaders=data(world * 2 * 2) if validate else None,
                    ckpt_path=ckpt_path)
        if save is not None:
            trainer.save_checkpoint(save)
        return trainer

    full = fit(GPTModule(meta=False), 4)
    first = GPTModule(meta=True)
    t = fit(first, 2, save=out / "two.ckpt", validate=True)
    result["val_loss"] = float(t.callback_metrics["val_loss"])
    resumed = GPTModule(meta=True)
    fit(resumed, 4, ckpt_path=out / "two.ckpt")
    # the same save and resume of the CPU-built model, for comparison
    fit(GPTModule(meta=False), 2, save=out / "two_cpu.ckpt")
    resumed_cpu = GPTModule(meta=False)
    fit(resumed_cpu, 4, ckpt_path=out / "two_cpu.ckpt")
    result["resumed_cpu_losses"] = resumed_cpu.losses
    result.update(cpu_losses=full.lightning_module.losses, meta_losses=first.losses, resumed_losses=resumed.losses)
    # a "pretrained" GPT: another seed, saved whole by rank 0 as safetensors and as a torch file
    if rank == 0:
        from safetensors.torch import save_file
        torch.manual_seed(99)
        net = GPTNet(vocab=40, dim=16, heads=2, layers=3, seq_len=8)
        weights = {k: v.contiguous() for k, v in net.state_dict().items() if k != "head.weight"}  # tied: one copy
        save_file(weights, str(out / "pre.safetensors"))
        torch.save(weights, out / "pre.pt")
    torch.distributed.barrier()  # the files are written (the Trainers left the process group up)
    for kind in ("safetensors", "pt"):
        tuned = GPTModule(meta=True, pretrained=str(out / f"pre.{kind}"))
        fit(tuned, 1)
        expected = torch.load(out / "pre.pt", weights_only=True)
        result[f"pretrained_{kind}"] = all(torch.equal(tuned.setup_values[f"net.{k}"], v) for k, v in expected.items())
        result[f"pretrained_{kind}_bytes"] = tuned.param_bytes
    # load_pretrained into a strategy already set up
    class Load(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            load_pretrained(trainer.strategy, out / "pre.safetensors", prefix="net.")
            pl_module.loaded = {k: v.clone() for k, v in trainer.strategy.engine.full_state_dict().items()}

    late = GPTModule(meta=True)
    L.Trainer(accelerator="cpu", devices=world, strategy=PaROStrategy(sharding="GGG", group_size=2), max_steps=1,
              logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[Load()]).fit(late, data(world * 2))
    expected = torch.load(out / "pre.pt", weights_only=True)
    result["load_pretrained"] = all(torch.equal(late.loaded[f"net.{k}"], v) for k, v in expected.items())
    result["full_param_bytes"] = sum(v.numel() * v.element_size() for k, v in expected.items())
    return result


for mode in modes:
    (out / f"{mode}.{rank}.json").write_text(json.dumps({"values": values, "trainer": trainer_checks}[mode]()))
