"""What one GPU can check of the package, in one short run: ``bash scripts/gpu_check.sh`` (see that file).

Checks, each reported on its own line and summed up in the last line:

1. ``fit-bf16-mixed``: the demo GPT trains 4 steps under ``PaROStrategy`` with ``precision="bf16-mixed"``, saves a
   sharded checkpoint, and a second Trainer resumes from it to step 8; its losses after the resume and its final
   weights match an uninterrupted 8-step run.
2. ``fit-bf16-true``: the same with ``precision="bf16-true"`` (bf16 parameters, fp32 master in the optimizer shard).
3. ``backend``: the default process group carries both CUDA tensors (NCCL) and CPU tensors (gloo).
4. ``placement``: after ``fit``, every buffer the engine holds (parameter, gradient and optimizer shards, the
   "used" flags, optimizer states) is on the GPU, and every tensor handed to a collective during the run was on the
   device its backend carries.
5. ``predict``: elastic batch prediction with the model on the GPU writes every row once, equal to a plain forward.

A world size of one is all one GPU allows (NCCL refuses two ranks on one device), so the collectives between ranks
are not exercised here; the multi-process tests cover them on CPU. ``--cpu`` runs the same checks on the CPU with
gloo, to test this script itself.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: the resume check compares runs

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightning as L
from lightning_paro import PaROStrategy
from lightning_paro.demo.model import GPT, GPTConfig
from lightning_paro.predict import ElasticPredict, read_predictions

CFG = GPTConfig(seq_len=32, dim=64, heads=4, layers=2)
BATCH = 8


class ScoredGPT(GPT):
    """The demo GPT with a ``predict_step``: the loss of every sequence, in bits per byte."""

    def predict_step(self, batch, batch_idx):
        logits = self(batch[:, :-1])
        nll = F.cross_entropy(logits.float().transpose(1, 2), batch[:, 1:], reduction="none").mean(1)
        return {"bits_per_byte": nll / math.log(2)}


def byte_data(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (rows, CFG.seq_len), generator=torch.Generator().manual_seed(seed))


class CollectiveRecorder:
    """Wraps torch.distributed's collectives and point-to-point calls; records each call's tensor devices."""

    NAMES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
             "reduce_scatter_single", "send", "recv", "isend", "irecv", "batch_isend_irecv")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self._originals: dict[str, Callable] = {}

    def __enter__(self) -> "CollectiveRecorder":
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._originals[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def recorded(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            self.calls.append((name, threading.current_thread().name, tuple(str(t.device) for t in tensors)))
            return fn(*args, **kwargs)
        return recorded


def make_trainer(device: str, precision: str, max_steps: int, root: Path, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator=device, devices=1, strategy=PaROStrategy(sharding="GGG", group_size=1),
                     precision=precision, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root),
                     num_sanity_val_steps=0, limit_val_batches=0, deterministic=True, use_distributed_sampler=False,
                     **kwargs)


def check_fit_and_resume(device: str, precision: str, root: Path) -> str:
    # Every batch the same: a plain DataLoader does not resume mid-epoch at the same batch, and the check is about
    # the model and optimizer states that the checkpoint carries, not the data order.
    loader = lambda: DataLoader(byte_data(BATCH).repeat(4, 1), batch_size=BATCH)  # noqa: E731
    L.seed_everything(7, verbose=False)
    straight = ScoredGPT(CFG)
    make_trainer(device, precision, 8, root).fit(straight, loader())

    L.seed_everything(7, verbose=False)
    first = ScoredGPT(CFG)
    trainer = make_trainer(device, precision, 4, root)
    trainer.fit(first, loader())
    ckpt = root / f"{precision}.ckpt"
    trainer.save_checkpoint(ckpt)
    if not ckpt.is_dir():
        raise AssertionError(f"the default checkpoint is sharded (a directory), got a file at {ckpt}")

    resumed = ScoredGPT(CFG)
    make_trainer(device, precision, 8, root).fit(resumed, loader(), ckpt_path=str(ckpt))
    after = straight.step_losses[4:]
    # bf16-true rebuilds the fp32 master from the bf16 weights on load (README, Checkpoints): allow two bf16 steps of
    # the loss (1/32 each between 4 and 8). The other precisions resume exactly up to kernel nondeterminism.
    tolerance = 0.07 if precision == "bf16-true" else 2e-2
    if len(resumed.step_losses) != 4 or max(abs(a - b) for a, b in zip(resumed.step_losses, after)) > tolerance:
        raise AssertionError(f"losses after resume {resumed.step_losses} differ from the straight run's {after}")
    worst = max((a.float() - b.float()).abs().max().item()
                for a, b in zip(resumed.state_dict().values(), straight.state_dict().values()))
    if worst > 2e-2:
        raise AssertionError(f"weights after resume differ from the straight run's by {worst:.3g}")
    if straight.step_losses[-1] >= straight.step_losses[0]:
        raise AssertionError(f"the loss did not fall: {straight.step_losses}")
    return f"loss {straight.step_losses[0]:.3f} -> {straight.step_losses[-1]:.3f}, resume max weight diff {worst:.2g}"


def check_placement(device: str, root: Path, recorder: CollectiveRecorder) -> str:
    """Fit once more with the strategy kept, then inspect the engine before teardown gives the module back."""
    held: dict[str, list[str]] = {}

    class Inspect(L.Callback):
        def on_train_end(self, trainer, pl_module):
            engine = trainer.strategy.engine
            for unit in engine.units:
                for i, f in enumerate(unit.flats):
                    named = {"p_local": f.p_local, "p_full": f.p_full, "g_full": f.g_full, "g_shard": f.g_shard,
                             "master": f.master, "used": f.used}
                    for key, t in named.items():
                        if torch.is_tensor(t):
                            held.setdefault(str(t.device), []).append(f"{unit.name}[{i}].{key}")
            for opt in engine.optimizers:
                for state in opt.state.values():
                    for key, t in state.items():
                        if torch.is_tensor(t) and t.dim() > 0:
                            held.setdefault(str(t.device), []).append(f"optimizer state {key}")

    first = len(recorder.calls)
    trainer = make_trainer(device, "bf16-mixed", 3, root, callbacks=[Inspect()], gradient_clip_val=1.0)
    trainer.fit(ScoredGPT(CFG), DataLoader(byte_data(3 * BATCH), batch_size=BATCH))
    want = "cuda:0" if device == "cuda" else "cpu"
    stray = {dev: names[:5] for dev, names in held.items() if dev != want}
    if stray:
        raise AssertionError(f"engine buffers off the compute device {want}: {stray}")
    calls = recorder.calls[first:]
    backend = str(dist.get_backend()) if dist.is_initialized() else "none"
    carried = {"cuda"} if "nccl" in backend else set()
    carried |= {"cpu"} if "gloo" in backend else set()
    off = [c for c in calls if any(d.split(":")[0] not in carried for d in c[2])]
    if off:
        raise AssertionError(f"collectives given tensors off {want} with backend {backend}: {off[:5]}")
    threads = sorted({c[1] for c in calls})
    return f"{sum(map(len, held.values()))} engine tensors on {want}; {len(calls)} collectives from threads {threads}"


def check_backend(device: str) -> str:
    if not dist.is_initialized():
        raise AssertionError("no process group after fit")
    backend = str(dist.get_backend())
    if device == "cuda" and not ("nccl" in backend and "gloo" in backend):
        raise AssertionError(f"default backend is {backend!r}; it should carry CUDA (nccl) and CPU (gloo) tensors")
    probe = {"cpu": torch.ones(1)}
    if device == "cuda":
        probe["cuda"] = torch.ones(1, device="cuda")
    for where, t in probe.items():
        dist.all_reduce(t)
        if t.item() != 1.0:
            raise AssertionError(f"all_reduce of a {where} tensor gave {t.item()}")
    return f"backend {backend}; all_reduce works on {sorted(probe)} tensors"


def check_predict(device: str, root: Path) -> str:
    L.seed_everything(3, verbose=False)
    model = ScoredGPT(CFG)
    data = byte_data(200, seed=5)
    out = root / "predictions"
    trainer = L.Trainer(accelerator=device, devices=1, logger=False, enable_progress_bar=False,
                        callbacks=[ElasticPredict(str(out), shard_size=48)])
    trainer.predict(model, dataloaders=DataLoader(data, batch_size=16))
    table = read_predictions(str(out))
    if table.num_rows != len(data) or table.column("row_id").to_pylist() != list(range(len(data))):
        raise AssertionError(f"{table.num_rows} rows written for {len(data)}, or out of order")
    model = model.to(device).eval()
    with torch.no_grad():
        want = model.predict_step(data.to(device), 0)["bits_per_byte"].cpu()
    got = torch.tensor(table.column("bits_per_byte").to_pylist())
    worst = (got - want).abs().max().item()
    if worst > 1e-3:
        raise AssertionError(f"predictions differ from a plain forward by {worst:.3g}")
    return f"{table.num_rows} rows, max diff from a plain forward {worst:.2g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU with gloo (a self-test)")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    started = time.monotonic()
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: FAIL no CUDA device visible to torch"
              f" {torch.__version__} (CUDA build: {torch.version.cuda}); run it on a GPU machine, or --cpu")
        return 2
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    torch.use_deterministic_algorithms(True, warn_only=True)
    results: list[tuple[str, bool, str]] = []
    with tempfile.TemporaryDirectory() as tmp, CollectiveRecorder() as recorder:
        root = Path(tmp)
        checks: list[tuple[str, Callable[[], str]]] = [
            ("fit-bf16-mixed", lambda: check_fit_and_resume(device, "bf16-mixed", root)),
            ("fit-bf16-true", lambda: check_fit_and_resume(device, "bf16-true", root)),
            ("backend", lambda: check_backend(device)),
            ("placement", lambda: check_placement(device, root, recorder)),
            ("predict", lambda: check_predict(device, root)),
        ]
        for label, check in checks:
            t0 = time.monotonic()
            try:
                detail = check()
                results.append((label, True, detail))
            except Exception as err:  # noqa: BLE001  (every check runs; the summary names the failures)
                traceback.print_exc()
                results.append((label, False, f"{type(err).__name__}: {err}"))
            ok, detail = results[-1][1:]
            print(f"gpu_check: {label}: {'ok' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s) {detail}",
                  flush=True)
    failed = [label for label, ok, _ in results if not ok]
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name}"
    verdict = "PASS" if not failed else "FAIL " + ",".join(failed)
    print(f"gpu_check: {verdict} {len(results) - len(failed)}/{len(results)} on {device} ({versions})"
          f" in {time.monotonic() - started:.0f} s")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
