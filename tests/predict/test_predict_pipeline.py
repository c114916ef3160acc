"""Multi-model pipelines: stages in their own processes, ordered exactly-once output, commit after the last stage."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_paro.predict import read_errors
from lightning_paro.predict.pipeline import (
    PipelineStage,
    PipelineStageError,
    allocate_replicas,
    run_pipeline,
)
from predict_app import JobSpec, RowsDataset
from predict_procs import assert_exact_output


class Embed(torch.nn.Module):
    """Stage 1: x -> h = 3x (as a dict, to exercise structured hand-over between stages)."""

    def forward(self, batch):
        return {"h": batch["x"][:, 0] * 3.0, "key": batch["key"]}


class Head(torch.nn.Module):
    """Stage 2: h -> y = h + 1; refuses row 77 (a poison row in the second model)."""

    def __init__(self, die_on_row=None) -> None:
        super().__init__()
        self.die_on_row = die_on_row

    def forward(self, batch):
        rows = [int(h // 3) for h in batch["h"].tolist()]
        if 77 in rows:
            raise ValueError("head cannot score row 77")
        if self.die_on_row is not None and self.die_on_row in rows and _should_die():
            os.kill(os.getpid(), signal.SIGKILL)
        return {"y": batch["h"] + 1.0}


def _should_die() -> bool:
    """PIPELINE_TEST_DIE=always: die every time; =once:PATH: die the first time only (PATH marks it)."""
    mode = os.environ.get("PIPELINE_TEST_DIE", "")
    if mode == "always":
        return True
    if mode.startswith("once:"):
        marker = mode[len("once:"):]
        if not os.path.exists(marker):
            open(marker, "w").close()
            return True
    return False


def build_embed():
    return Embed()


def build_head():
    return Head()


def build_dying_head():
    return Head(die_on_row=150)


def loader(rows: int):
    return DataLoader(RowsDataset(JobSpec(output_dir="unused", rows=rows)), batch_size=10)


@pytest.mark.timeout(60)
def test_two_stage_pipeline_writes_every_row_once_in_order(tmp_path):
    out = tmp_path / "out"
    stages = [PipelineStage("embed", build_embed, replicas=1), PipelineStage("head", build_head, batch_size=4, replicas=2)]
    report = run_pipeline(stages, loader(300), str(out), shard_size=50, max_failed_rows=1, lease_ttl_s=5.0)
    assert report.replicas == {"embed": 1, "head": 2}
    assert report.manifest is not None and report.manifest["rows_failed"] == 1
    assert_exact_output(out, 300, skip={77})
    [error] = read_errors(out)
    assert error["row_id"] == 77 and error["stage"] == "head" and "cannot score row 77" in error["error"]


def test_replicas_go_to_the_bottleneck_stage():
    assert allocate_replicas({"detect": 1.0, "classify": 3.0}, total=4, fixed={}) == {"detect": 1, "classify": 3}
    assert allocate_replicas({"a": 1.0, "b": 1.0, "c": 8.0}, total=4, fixed={"c": 1}) == {"a": 2, "b": 1, "c": 1}


@pytest.mark.timeout(60)
def test_profiling_pass_chooses_replica_counts(tmp_path):
    out = tmp_path / "out"
    stages = [PipelineStage("embed", build_embed), PipelineStage("head", build_head)]
    report = run_pipeline(stages, loader(120), str(out), shard_size=40, max_replicas=3, max_failed_rows=1)
    assert set(report.profile_s_per_row) == {"embed", "head"}
    assert sum(report.replicas.values()) == 3 and min(report.replicas.values()) >= 1
    assert_exact_output(out, 120, skip={77})


@pytest.mark.timeout(60)
def test_a_dead_stage_fails_clearly_and_a_rerun_completes_exactly(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("PIPELINE_TEST_DIE", "always")
    stages = [PipelineStage("embed", build_embed, replicas=1), PipelineStage("head", build_dying_head, replicas=1)]
    with pytest.raises(PipelineStageError, match="stage 'head' died .*already restarted 1 times"):
        run_pipeline(stages, loader(300), str(out), shard_size=50, max_failed_rows=1, lease_ttl_s=5.0,
                     max_stage_restarts=1)
    assert not (out / "_manifest.json").exists()
    monkeypatch.setenv("PIPELINE_TEST_DIE", "")
    run_pipeline(stages, loader(300), str(out), shard_size=50, max_failed_rows=1, lease_ttl_s=5.0)
    assert_exact_output(out, 300, skip={77})


@pytest.mark.timeout(60)
def test_a_stage_replica_that_dies_once_is_restarted_and_its_batches_replayed(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("PIPELINE_TEST_DIE", f"once:{tmp_path / 'died'}")
    stages = [PipelineStage("embed", build_embed, replicas=1), PipelineStage("head", build_dying_head, replicas=2)]
    report = run_pipeline(stages, loader(300), str(out), shard_size=50, max_failed_rows=1, lease_ttl_s=5.0)
    assert (tmp_path / "died").exists() and report.stage_restarts == 1
    assert_exact_output(out, 300, skip={77})
