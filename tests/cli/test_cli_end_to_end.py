"""The command line as users run it: fit -> checkpoint -> predict on a tiny config under Lightning's subprocess
launcher, a multirun sweep, bench with the spawn start method, fit under torchrun, and config errors from the real
entry point. Every run starts in a fresh working directory with a relative run.dir."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import lightning_paro
from cli.procs import free_port, run_cli
from lightning_paro.cli.build import build_model
from lightning_paro.cli.compose import load_config
from lightning_paro.demo.data import FileBytes, split_files
from lightning_paro.predict import read_predictions

TINY = ["model=gpt_tiny", "data=stdlib_tiny", "trainer=tiny"]


@pytest.mark.timeout(240)
def test_fit_checkpoint_predict(tmp_path):
    fit = run_cli(["fit", *TINY, "strategy=paro", "strategy.sharding=IIG", "run.name=e2e"], tmp_path, timeout=220)
    assert fit.returncode == 0, fit.describe()
    run_dir = tmp_path / "runs" / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "paro IIG" and summary["world_size"] == 2 and summary["optimizer_steps"] == 4
    losses = summary["loss_per_step_rank0"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert 0 < summary["validation"]["val_bits_per_byte"] < 12
    # one group of 2 ranks: IIG moves bytes inside the group only
    assert summary["intra_bytes_per_step"] > 0 and summary["inter_bytes_per_step"] == 0
    assert "PaRO strategy IIG" in fit.stdout and "model states on this rank" in fit.stdout
    ckpt = run_dir / "weights.ckpt"  # strategy=paro's checkpoints are the library's: a sharded directory
    assert ckpt.is_dir() and str(ckpt) in fit.stdout and "python -m lightning_paro.convert" in fit.stdout
    assert (run_dir / "logs" / "version_0" / "metrics.csv").is_file()
    # the progress bar was off (trainer=tiny); the composed config is saved beside the checkpoint
    assert "_target_: lightning_paro.demo.GPTTask" in (run_dir / "config.yaml").read_text()

    cfg = load_config([*TINY, "run.name=e2e"], cwd=tmp_path)
    state = lightning_paro.load_checkpoint(ckpt)
    assert "optimizer_states" not in state  # a weights checkpoint
    model = build_model(cfg)
    model.load_state_dict(state["state_dict"])  # strict: every key of the model, nothing else

    pred = run_cli(["predict", *TINY, "run.name=e2e"], tmp_path, timeout=200)
    assert pred.returncode == 0, pred.describe()
    table = read_predictions(run_dir / "predictions").to_pylist()
    data = cfg.data
    _, held_out = split_files(data["train_bytes"], data["held_out_bytes"])
    files = FileBytes(held_out, cfg.model["seq_len"], data["max_bytes_per_file"])
    assert [row["path"] for row in table] == [files[i]["path"] for i in range(len(files))]
    assert len(table) >= 2
    # the scores are the checkpoint's: recompute two files in this process
    model.eval()
    with torch.no_grad():
        for i in (0, len(files) - 1):
            batch = torch.utils.data.default_collate([files[i]])
            expected = model.predict_step(batch)
            assert table[i]["bits_per_byte"] == pytest.approx(expected["bits_per_byte"].item(), rel=1e-5)
            assert table[i]["bytes_scored"] == expected["bytes_scored"].item() == min(
                data["max_bytes_per_file"], held_out[i].stat().st_size) - 1
    assert f"predicted {len(table)} rows with weights.ckpt (row_id, path, bits_per_byte, bytes_scored)" in pred.stdout
    assert json.loads((run_dir / "predict.json").read_text())["rows"] == len(table)


@pytest.mark.timeout(240)
def test_multirun_sweep_runs_each_job_once_with_its_own_ranks(tmp_path):
    sweep = run_cli(["fit", "-m", *TINY, "strategy.sharding=NIG,GGG", "trainer.limit_val_batches=0",
                     "run.name=sweep"], tmp_path, timeout=220)
    assert sweep.returncode == 0, sweep.describe()
    base = tmp_path / "runs" / "sweep"
    assert sorted(p.name for p in base.iterdir() if p.is_dir()) == ["0", "1"]
    record = json.loads((base / "sweep.json").read_text())
    assert [job["overrides"] for job in record["jobs"]] == [["strategy.sharding=NIG"], ["strategy.sharding=GGG"]]
    assert [job["exit_code"] for job in record["jobs"]] == [0, 0]
    results = [json.loads((base / str(i) / "summary.json").read_text()) for i in range(2)]
    assert [r["strategy"] for r in results] == ["paro NIG", "paro GGG"]
    for job in range(2):
        # a rank that started a sweep of its own would have written more runs; each job trained once
        assert sorted(p.name for p in (base / str(job) / "logs").iterdir()) == ["version_0"]
        assert results[job]["world_size"] == 2 and results[job]["optimizer_steps"] == 4
    # the two shardings compute the same training: same losses
    assert results[0]["loss_per_step_rank0"] == pytest.approx(results[1]["loss_per_step_rank0"], abs=1e-4)
    assert sweep.stdout.count("[sweep] job ") == 2


@pytest.mark.timeout(200)
def test_bench_with_the_spawn_start_method(tmp_path):
    bench = run_cli(["bench", *TINY, "strategy=paro_ggg", "strategy.start_method=spawn", "bench.warmup_steps=1",
                     "bench.steps=2", "model.trainable_blocks=1", "run.name=b"], tmp_path, timeout=180)
    assert bench.returncode == 0, bench.describe()
    result = json.loads((tmp_path / "runs" / "b" / "bench.json").read_text())
    assert result["strategy"] == "paro GGG" and result["world_size"] == 2 and result["timed_steps"] == 2
    assert result["samples_per_step"] == 4 * 2 * 2  # batch x accumulation x ranks
    assert result["tokens_per_step"] == 4 * 32 * 2 * 2  # ... x seq_len (GPTTask.tokens_per_sample)
    assert result["tokens_per_s"] > 0 and result["inter_bytes_per_step"] == 0
    # PEFT-like: one of the two blocks (and the final norm) trains; the engine's gradients cover only those
    assert 0 < result["trainable_parameters"] < result["parameters"] / 2
    states = result["model_state_bytes_rank0"]
    assert states["grads"] < states["params"] / 2 and result["model_state_bytes_max_rank"] >= sum(states.values())
    assert math.isfinite(result["final_loss"]) and result["peak_rss_bytes_max_rank"] > 50 * 2**20
    assert result["accumulating_micro_step_s"] > 0  # accumulation 2: one micro-batch per step does no step
    assert result["accumulating_micro_step_mean_s"] > 0
    assert "tokens/s" in bench.stdout


@pytest.mark.timeout(200)
def test_fit_under_torchrun(tmp_path):
    prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
              "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "lightning_paro"]
    fit = run_cli(["fit", *TINY, "strategy=paro_nig", "strategy.group_size=1", "trainer.limit_val_batches=0",
                   "run.name=tr"], tmp_path, timeout=180, prefix=prefix)
    assert fit.returncode == 0, fit.describe()
    summary = json.loads((tmp_path / "runs" / "tr" / "summary.json").read_text())
    # group_size=1: two groups of one, so everything crosses groups
    assert summary["strategy"] == "paro NIG (m=1)" and summary["world_size"] == 2
    assert summary["inter_bytes_per_step"] > 0 and summary["intra_bytes_per_step"] == 0
    assert (tmp_path / "runs" / "tr" / "weights.ckpt").is_dir()  # sharded, the library's default


@pytest.mark.timeout(120)
def test_a_config_error_is_one_line_from_the_entry_point(tmp_path):
    # a sweep whose second job has a bad value: refused before the first job starts (the other errors are
    # checked in-process in test_config.py, through the same main())
    done = run_cli(["fit", "-m", "strategy.sharding=NIG,XYZ"], tmp_path, timeout=100)
    assert done.returncode == 2 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "lightning-paro: error: job 2 of 2 (strategy.sharding=XYZ): strategy.sharding: 'XYZ'"), done.stderr
    assert not (tmp_path / "runs").exists()  # nothing ran


@pytest.mark.timeout(200)
def test_fsdp2_shards_a_model_that_does_not_shard_itself(tmp_path):
    # GPTTask has no configure_model: the fsdp2 strategy applies fully_shard to its blocks and to the whole model
    bench = run_cli(["bench", *TINY, "strategy=fsdp2", "bench.warmup_steps=1", "bench.steps=1", "run.name=f"],
                    tmp_path, timeout=180)
    assert bench.returncode == 0, bench.describe()
    result = json.loads((tmp_path / "runs" / "f" / "bench.json").read_text())
    assert result["strategy"] == "fsdp2" and result["world_size"] == 2
    # every parameter is a DTensor split over the 2 ranks: rank 0 holds about half of the fp32 parameters
    assert result["model_state_bytes_rank0"]["params"] == pytest.approx(4 * result["parameters"] / 2, rel=0.05)


@pytest.mark.timeout(400)
def test_fit_resumes_from_the_run_s_last_checkpoint(tmp_path):
    common = [*TINY, "strategy=paro_nig", "callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=2",
              "trainer.limit_val_batches=0", "run.name=resume"]
    first = run_cli(["fit", *common, "trainer.max_steps=2"], tmp_path, timeout=180)
    assert first.returncode == 0, first.describe()
    last = tmp_path / "runs" / "resume" / "checkpoints" / "last.ckpt"
    assert last.is_dir()  # sharded
    again = run_cli(["fit", *common, "trainer.max_steps=4", "ckpt_path=last"], tmp_path, timeout=180)
    assert again.returncode == 0, again.describe()
    summary = json.loads((tmp_path / "runs" / "resume" / "summary.json").read_text())
    # steps 3 and 4 only: the first two came from the checkpoint
    assert summary["optimizer_steps"] == 4 and len(summary["loss_per_step_rank0"]) == 2


@pytest.mark.timeout(400)
def test_an_experiment_with_a_paro_key_compares_paro_with_ddp_in_one_sweep(tmp_path):
    # experiment=demo sets strategy.group_size, which DDP has no key for: the ddp job leaves it out and says so
    sweep = run_cli(["bench", "-m", "experiment=demo", "strategy=paro_iig,ddp", "model=gpt_tiny", "data=stdlib_tiny",
                     "trainer.devices=2", "trainer.enable_progress_bar=false", "bench.warmup_steps=1", "bench.steps=1",
                     "run.name=compare"], tmp_path, timeout=380)
    assert sweep.returncode == 0, sweep.describe()
    record = json.loads((tmp_path / "runs" / "compare" / "sweep.json").read_text())
    assert [job["exit_code"] for job in record["jobs"]] == [0, 0]
    assert [job["result"]["strategy"] for job in record["jobs"]] == ["paro IIG (m=2)", "ddp"]
    assert sweep.stdout.count("note: strategy=ddp has no strategy.group_size=2") == 1
