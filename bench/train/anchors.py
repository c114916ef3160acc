"""The anchors tuned as their users tune them, and the worker every rank of an anchor run executes.

An anchor is a Lightning strategy with the communication savings its own users reach for:

* ``ddp_bf16hook``: DDP with a bf16 gradient-compression hook. On CUDA it is torch's ``bf16_compress_hook``; on
  CPU/gloo torch's hook is refused and Lightning registers ``ddp_comm_hook`` on CUDA only, so :func:`bf16_cast_hook`
  (the same meaning: divide by the world size, cast the bucket to bf16, all-reduce, cast back) is registered on the
  DDP wrapper here.
* ``ddp_powersgd``: DDP with torch's PowerSGD hook, rank 4, error feedback and warm start on, and
  ``start_powerSGD_iter`` as torch's documentation suggests (10% of the run's optimizer steps, at least 2, the least
  torch allows with error feedback). Off CUDA the whole model is one DDP bucket (``POWERSGD_GLOO_BUCKET_MB``: with
  several, gloo aborts on PowerSGD's interleaved all-reduces).
* ``fsdp2_bf16`` / ``hsdp_bf16``: FSDP2 full sharding and HSDP with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=bf16)``.

The worker (``python bench/train/anchors.py --anchor NAME -- OVERRIDES``) runs the package's ``bench`` command's
flow (the same model, data, callbacks and ``bench.json``) with the anchor's strategy in place of the configured one,
``--anchor none`` keeping the configured strategy (so PaRO rows can be measured by the same worker). Every run adds
the bytes that crossed the emulated NICs during the timed steps (``/proc/net/dev`` of each node's namespace), so every
row of the compression table has its bytes between groups per step measured the same way. With ``--curve K`` the
worker instead validates on the held-out data every K optimizer steps and writes the curve (``accuracy.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

ANCHORS = ("ddp_bf16hook", "ddp_powersgd", "fsdp2_bf16", "hsdp_bf16")
POWERSGD_RANK = 4
"""PowerSGD's matrix approximation rank (the issue's setting; torch suggests 1-4)."""
POWERSGD_MIN_START = 2
"""The least ``start_powerSGD_iter`` torch allows with error feedback or warm start."""
POWERSGD_GLOO_BUCKET_MB = 4096
"""DDP's bucket cap for PowerSGD off CUDA: the whole model in one bucket. PowerSGD issues each bucket's second
all-reduce (Q) from the first one's (P) future callback, so with several buckets the ranks issue their buckets' P
and Q all-reduces in timing-dependent orders, and gloo, which pairs collectives by the order they are issued, aborts
on a size mismatch (measured at the benchmark's GPT with DDP's default 25 MB buckets; one bucket runs)."""


def powersgd_start(total_steps: int) -> int:
    """``start_powerSGD_iter`` as torch's documentation suggests: 10% of the run's optimizer steps, at least 2."""
    return max(POWERSGD_MIN_START, math.ceil(0.1 * total_steps))


def bf16_cast_hook(process_group, bucket):  # noqa: ANN001, ANN201 (DDP refuses a bucket annotation other than its own)
    """A DDP communication hook with the meaning of torch's ``bf16_compress_hook`` that gloo accepts: the bucket is
    divided by the world size, cast to bf16, all-reduced in bf16 and cast back into the bucket."""
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    compressed = bucket.buffer().div(dist.get_world_size(group)).to(torch.bfloat16)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: Any) -> Any:
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out

    return future.then(decompress)


def build_anchor(name: str, cfg: Any, total_steps: int) -> Any:
    """The strategy object of anchor ``name`` for the composed config ``cfg`` (its world, group and timeout)."""
    from datetime import timedelta

    from lightning_paro.cli.checks import world_size

    if name not in ANCHORS:
        raise SystemExit(f"no anchor {name!r}: the anchors are {', '.join(ANCHORS)}")
    timeout = timedelta(seconds=getattr(cfg.strategy, "timeout_s", 1800))
    backend = getattr(cfg.strategy, "process_group_backend", None)
    if name.startswith("ddp"):
        return HookedDDP(name, total_steps, timeout=timeout, process_group_backend=backend,
                         start_method=getattr(cfg.strategy, "start_method", "popen"))
    world = world_size(cfg.trainer)
    devices = cfg.trainer.get("devices")
    per_node = len(devices) if isinstance(devices, list) else int(devices)
    group = per_node if name == "hsdp_bf16" else None
    return MixedFSDP2(world, group_size=group, timeout=timeout, process_group_backend=backend)


def _hooked_ddp_class() -> type:
    from lightning.pytorch.strategies import DDPStrategy
    from typing_extensions import override

    class _HookedDDP(DDPStrategy):
        """Lightning's DDP with a communication hook registered on the DDP wrapper on every device type."""

        def __init__(self, anchor: str, total_steps: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.anchor = anchor
            self.total_steps = total_steps
            self.powersgd_state: Any = None

        @override
        def _setup_model(self, model: Any) -> Any:
            if self.anchor == "ddp_powersgd" and self.root_device.type != "cuda":
                self._ddp_kwargs.setdefault("bucket_cap_mb", POWERSGD_GLOO_BUCKET_MB)
            return super()._setup_model(model)

        @override
        def _register_ddp_hooks(self) -> None:
            import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            if self.anchor == "ddp_bf16hook":
                hook = bf16_compress_hook if self.root_device.type == "cuda" else bf16_cast_hook
                self.model.register_comm_hook(None, hook)
                return
            self.powersgd_state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                start_powerSGD_iter=powersgd_start(self.total_steps), use_error_feedback=True, warm_start=True)
            self.model.register_comm_hook(self.powersgd_state, powersgd.powerSGD_hook)

        def powersgd_report(self) -> dict:
            """The PowerSGD settings this run used, read from its state and its DDP wrapper's arguments."""
            state = self.powersgd_state
            return {"rank": state.matrix_approximation_rank, "start_powerSGD_iter": state.start_powerSGD_iter,
                    "error_feedback": state.use_error_feedback, "warm_start": state.warm_start,
                    "bucket_cap_mb": self._ddp_kwargs.get("bucket_cap_mb")}

    return _HookedDDP


def HookedDDP(anchor: str, total_steps: int, **kwargs: Any) -> Any:  # noqa: N802 (a class built lazily)
    return _hooked_ddp_class()(anchor, total_steps, **kwargs)


def MixedFSDP2(world: int, group_size: Optional[int], **kwargs: Any) -> Any:  # noqa: N802
    """The package's FSDP2/HSDP anchor with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``."""
    import torch
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_paro.cli.build import FSDP2Strategy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)

    class _MixedFSDP2(FSDP2Strategy):
        """The package's FSDP2 anchor, every ``fully_shard`` call of its set-up given the bf16 policy (its set-up
        imports ``fully_shard`` from ``torch.distributed.fsdp`` when it runs, so the function is wrapped there for the
        duration of the call)."""

        def setup(self, trainer: Any) -> None:
            original = fsdp.fully_shard
            calls = []

            def with_policy(module: Any, **kw: Any) -> Any:
                kw.setdefault("mp_policy", policy)
                calls.append(module)
                return original(module, **kw)

            fsdp.fully_shard = with_policy
            try:
                super().setup(trainer)
            finally:
                fsdp.fully_shard = original
            if not calls:  # the anchor would run in fp32 and be reported as bf16
                raise RuntimeError("FSDP2Strategy.setup no longer calls torch.distributed.fsdp.fully_shard at run"
                                   " time, so the bf16 policy was not applied: pass the policy to it another way")

    return _MixedFSDP2(world, group_size=group_size, **kwargs)


# ------------------------------------------------------------------------------------------------ measurements


def nic_tx_bytes(interface: Optional[str]) -> Optional[int]:
    """Bytes this process's network namespace has sent on ``interface`` (``/proc/net/dev``), or None without one."""
    if not interface:
        return None
    try:
        text = Path("/proc/net/dev").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            return int(fields.split()[8])
    return None


def resident_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``)."""
    import resource

    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


EXCEEDED = "memory_limit_exceeded"
"""Name stem of the file a rank writes to run.dir when it crosses ``--memory-limit`` (every rank then stops)."""
EXCEEDED_EXIT = 75


class Growth:
    """The largest growth of this rank's resident set above its start that the watcher has seen."""

    peak = 0


def enforce_memory_limit(limit: int, run_dir: Path, poll_s: float = 0.005) -> Growth:
    """Stop the run when this rank's resident set grows more than ``limit`` bytes above what it is now (the process
    with its imports, before the model): a thread reads it every ``poll_s`` seconds; a rank that crosses the limit
    writes ``memory_limit_exceeded_rank<R>.json`` to ``run_dir`` and exits with status 75, and every other rank exits
    when it sees that file (so that no rank waits in a collective for one that is gone)."""
    import threading

    base = resident_bytes()
    rank = os.environ.get("RANK", "0")
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob(f"{EXCEEDED}_rank*.json"):
        if old.name == f"{EXCEEDED}_rank{rank}.json":
            old.unlink(missing_ok=True)  # this rank's file from an earlier run in the same folder

    growth = Growth()

    def watch() -> None:
        import time

        while True:
            grown = resident_bytes() - base
            growth.peak = max(growth.peak, grown)
            if grown > limit:
                (run_dir / f"{EXCEEDED}_rank{rank}.json").write_text(json.dumps(
                    {"rank": int(rank), "grown_bytes": grown, "limit_bytes": limit, "base_bytes": base}))
                print(f"rank {rank}: resident set {grown / 2**20:.1f} MiB above its start, over the enforced limit"
                      f" of {limit / 2**20:.1f} MiB: stopping the run", flush=True)
                os._exit(EXCEEDED_EXIT)
            if any(run_dir.glob(f"{EXCEEDED}_rank*.json")):
                os._exit(EXCEEDED_EXIT)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="memory-limit", daemon=True).start()
    return growth


def _callbacks() -> tuple[type, type]:
    import lightning as L
    import torch

    class NicWindow(L.Callback):
        """The emulated NICs' sent bytes over the timed steps: read when the warm-up steps are done and at the end;
        node-local rank 0 reads its node's NIC (one NIC per node) and rank 0 adds the sum per step to bench.json."""

        def __init__(self, warmup: int, report: Path, growth: Optional[Growth] = None) -> None:
            self.warmup, self.report, self.growth = warmup, report, growth
            self.interface = os.environ.get("GLOO_SOCKET_IFNAME")
            self.start: Optional[int] = None
            self.start_step: Optional[int] = None

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if self.start is None and trainer.global_step >= self.warmup:
                self.start, self.start_step = nic_tx_bytes(self.interface), trainer.global_step

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            from lightning_paro.cli.bench import gather_rows

            end = nic_tx_bytes(self.interface)
            reads = self.start is not None and end is not None and os.environ.get("LOCAL_RANK", "0") == "0"
            row = torch.tensor([float(end - self.start) if reads else math.nan,
                                float(self.growth.peak) if self.growth is not None else math.nan],
                               dtype=torch.float64)
            ranks = gather_rows(row, trainer.world_size)
            if not trainer.is_global_zero or not self.report.exists():
                return
            steps = trainer.global_step - (self.start_step or 0)
            sent = [float(v) for v in ranks[:, 0] if not math.isnan(float(v))]
            result = json.loads(self.report.read_text())
            result["nic_inter_bytes_per_step"] = round(sum(sent) / steps) if sent and steps > 0 else None
            """Bytes every node's NIC sent (summed over the nodes) per timed optimizer step."""
            result["nic_nodes_read"] = len(sent)
            if self.growth is not None:  # the watcher's reading, the same baseline as its limit
                result["resident_growth_bytes_per_rank"] = [int(v) for v in ranks[:, 1]]
            self.report.write_text(json.dumps(result, indent=2))

    class HeldOutCurve(L.Callback):
        """The held-out loss at every validation (Lightning's loop: each strategy's own evaluation path, the loss
        averaged over the ranks by the model's ``validation_step``) and rank 0's training loss per optimizer step;
        rank 0 writes both to ``out`` at the end."""

        def __init__(self, out: Path) -> None:
            self.out = out
            self.curve: list[tuple[int, float]] = []
            self.train: dict[int, list[float]] = {}

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
                               ) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if torch.is_tensor(loss):
                self.train.setdefault(trainer.global_step, []).append(
                    float(loss.detach()) * trainer.accumulate_grad_batches)

        def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            value = trainer.callback_metrics.get("val_loss")
            if value is not None and not trainer.sanity_checking:
                self.curve.append((trainer.global_step, float(value)))

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.is_global_zero:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                train = [(step, sum(v) / len(v)) for step, v in sorted(self.train.items())]
                self.out.write_text(json.dumps({"held_out": self.curve, "train_rank0": train}, indent=2))

    return NicWindow, HeldOutCurve


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="One rank of an anchor (or configured-strategy) benchmark run.")
    ap.add_argument("--anchor", default="none", choices=("none", *ANCHORS))
    ap.add_argument("--curve", type=int, default=0, metavar="K",
                    help="validate on the held-out data every K optimizer steps and write curve.json to run.dir")
    ap.add_argument("--curve-batches", type=int, default=8, help="held-out batches per evaluation")
    ap.add_argument("--memory-limit", type=int, default=0, metavar="BYTES",
                    help="stop the run when a rank's resident set grows more than this above its start (after the"
                         " imports, before the model); the growth seen is reported either way")
    ap.add_argument("overrides", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides

    from lightning_paro import compat
    from lightning_paro.cli.bench import BENCH_FILE, LossRecorder, PeakMemory, StepTimer
    from lightning_paro.cli.build import build_data, build_model, build_trainer
    from lightning_paro.cli.compose import load_config
    from lightning_paro.cli.peak_memory import fix_mmap_threshold

    cfg = load_config(overrides)
    compat.check_private_apis()
    if cfg.bench.memory:
        fix_mmap_threshold()  # before anything large is allocated, as the bench command does
    growth = enforce_memory_limit(args.memory_limit, Path(cfg.run.dir)) if args.memory_limit else None
    total = cfg.bench.warmup_steps + cfg.bench.steps
    model = build_model(cfg)
    data = build_data(cfg)
    NicWindow, HeldOutCurve = _callbacks()
    losses = LossRecorder()
    memory = PeakMemory()
    run_dir = Path(cfg.run.dir)
    callbacks: list = [memory, losses]
    trainer_kw: dict[str, Any] = {}
    if args.curve:
        if total % args.curve:
            raise SystemExit(f"--curve {args.curve} must divide the run's {total} optimizer steps (bench.warmup_steps"
                             " + bench.steps), so that the last step is evaluated")
        callbacks.append(HeldOutCurve(run_dir / "curve.json"))
        accumulation = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
        trainer_kw = {"val_check_interval": args.curve * accumulation, "check_val_every_n_epoch": None,
                      "limit_val_batches": args.curve_batches, "num_sanity_val_steps": 0}
    else:
        callbacks += [StepTimer(cfg, losses, memory), NicWindow(cfg.bench.warmup_steps, run_dir / BENCH_FILE, growth)]
    if args.anchor != "none":
        trainer_kw["strategy"] = build_anchor(args.anchor, cfg, total)
    trainer = build_trainer(cfg, callbacks=callbacks, user_callbacks=False, loggers=False, max_steps=total,
                            validate=bool(args.curve), **trainer_kw)
    kwargs = data.fit_kwargs()
    if not args.curve:
        kwargs.pop("val_dataloaders", None)
    trainer.fit(model, **kwargs)
    if trainer.is_global_zero and not args.curve and args.anchor != "none":
        report = run_dir / BENCH_FILE
        result = json.loads(report.read_text())
        result["strategy"] = args.anchor
        if args.anchor == "ddp_powersgd":
            result["powersgd"] = trainer.strategy.powersgd_report()
        report.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
