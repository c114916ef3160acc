"""The training benchmark's anchors at tiny size on 2 CPU processes (gloo): DDP with the bf16 hook and with PowerSGD,
FSDP2 and HSDP with a bf16 mixed-precision policy, each training and reporting through the bench worker; the
enforced memory limit stops a run; on the emulated cluster (root), the NIC bytes of the timed steps are reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "bench" / "train" / "anchors.py"
TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "data.batch_size=2",
        "data.train_bytes=20000", "data.held_out_bytes=5000"]


def _run(anchor: str, strategy: str, out: Path, *extra: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(WORKER), "--anchor", anchor, *extra, "--", f"strategy={strategy}",
           "trainer.accelerator=cpu", "trainer.devices=2", "trainer.enable_progress_bar=false",
           "trainer.accumulate_grad_batches=2", "bench.warmup_steps=2", "bench.steps=2", f"run.dir={out}", *TINY]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_bf16_cast_hook_matches_the_mean_in_bf16() -> None:
    """The hook's arithmetic on one process (world of 1): the bucket comes back as its bf16 rounding."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "bench" / "train"))
    import anchors

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29627", rank=0, world_size=1)
    try:
        values = torch.tensor([1.0, 1 / 3, 1e-3 + 1e-6, -2.5])

        class Bucket:
            def __init__(self) -> None:
                self.b = values.clone()

            def buffer(self) -> torch.Tensor:
                return self.b

        out = anchors.bf16_cast_hook(None, Bucket()).wait()
        assert torch.equal(out, values.to(torch.bfloat16).to(torch.float32))
        assert not torch.equal(out, values)  # 1/3 is not a bf16 number: the cast happened
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("anchor", "strategy"), [("ddp_bf16hook", "ddp"), ("ddp_powersgd", "ddp"),
                                                  ("fsdp2_bf16", "fsdp2"), ("hsdp_bf16", "fsdp2")])
def test_each_anchor_trains_and_reports(anchor: str, strategy: str, tmp_path: Path) -> None:
    done = _run(anchor, strategy, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["strategy"] == anchor
    assert report["tokens_per_s"] > 0 and 0 < report["final_loss"] < 6.0
    if anchor == "ddp_powersgd":
        # one bucket on gloo: with several, PowerSGD's interleaved all-reduces abort gloo (anchors.py)
        assert report["powersgd"] == {"rank": 4, "start_powerSGD_iter": 2, "error_feedback": True, "warm_start": True,
                                      "bucket_cap_mb": 4096}
    if anchor.endswith("_bf16"):
        # FSDP2 computes in bf16 under the policy: its parameters' local shards stay fp32 (the policy casts copies)
        assert report["model_state_bytes_rank0"]["params"] > 0


@pytest.mark.timeout(300)
def test_the_enforced_memory_limit_stops_every_rank(tmp_path: Path) -> None:
    done = _run("ddp_bf16hook", "ddp", tmp_path, "--memory-limit", "1000", timeout=240)
    assert done.returncode != 0
    marks = list(tmp_path.glob("memory_limit_exceeded_rank*.json"))
    assert marks, done.stdout[-2000:] + done.stderr[-2000:]
    mark = json.loads(marks[0].read_text())
    assert mark["limit_bytes"] == 1000 and mark["grown_bytes"] > 1000
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root (network namespaces)")
def test_on_the_emulated_cluster_every_row_has_its_bytes_between_groups(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench" / "train"))
    import run

    s = run.Setting(2, 2, 100, 2, timed_steps=2)
    tiny = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "data.batch_size=1"]
    rows = {name: run.run_one(name, s, tmp_path / name.replace("~", "-"), worker=True, model=tiny, timeout=200)
            for name in ("ddp", "ddp_bf16hook")}
    for name, row in rows.items():
        assert "error" not in row, row.get("error")
        assert row["nic_nodes_read"] == 2 and row["nic_inter_bytes_per_step"] > 0
    # the bf16 hook halves the gradient bytes DDP sends between the nodes (headers and control traffic aside)
    ratio = rows["ddp_bf16hook"]["nic_inter_bytes_per_step"] / rows["ddp"]["nic_inter_bytes_per_step"]
    assert 0.4 < ratio < 0.75
