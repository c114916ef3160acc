"""The built wheel, as a user installs it: built from a clean copy of the sources without warnings, holding every
module and config file, installed in a fresh virtual environment, and run from an unrelated directory: the README's
walkthrough (a user's LightningModule, fit, predict, a two-strategy bench sweep), verbatim, with no environment
variable pointing at the sources."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from cli.procs import cli_env, run_cli

ROOT = Path(__file__).resolve().parents[1]


def _source_files() -> list[str]:
    """The files git would ship: tracked and untracked-but-not-ignored (never build/ or other leftovers)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    # A clean copy: a build/ directory left in the checkout by an earlier build would otherwise put deleted modules
    # into the wheel.
    src = tmp_path_factory.mktemp("src")
    for name in _source_files():
        target = src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the environment's setuptools builds it, so the test needs no package index.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                           str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("lightning_paro-*.whl")
    return built, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed. It sees this environment's packages (torch, Lightning)
    through a .pth file, whose own .pth files (this checkout's editable install among them) Python does not run."""
    built, _ = wheel
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_base_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(built)], check=True, capture_output=True, timeout=240)
    return env_dir


def _user_env(venv: Path) -> dict[str, str]:
    env = cli_env()
    for name in ("PYTHONPATH", "LIGHTNING_PARO_CONFIG_DIR", "VIRTUAL_ENV", "LIGHTNING_PARO_LAUNCH_TIME"):
        env.pop(name, None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.timeout(300)
def test_wheel_builds_without_warnings_and_holds_every_module_and_config(wheel):
    built, log = wheel
    # setuptools' own warnings (pip's notes about the machine's package indexes are not the package's concern)
    assert "deprecated" not in log.lower() and "BuildBackendWarning" not in log, log
    names = set(zipfile.ZipFile(built).namelist())
    sources = _source_files()
    modules = {n for n in sources if n.startswith("lightning_paro/") and n.endswith(".py")}
    configs = {"lightning_paro/" + n for n in sources if n.startswith("conf/")}
    assert modules and configs and modules | configs <= names, sorted((modules | configs) - names)
    shipped = {n for n in names if n.startswith("lightning_paro/")}
    assert shipped == modules | configs, sorted(shipped - modules - configs)  # nothing that is not in the sources


@pytest.mark.timeout(300)
def test_installed_wheel_registers_the_strategies_and_finds_its_configs(venv, tmp_path):
    script = (
        "import lightning as L, lightning_paro\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning_paro.cli.compose import package_config_dir\n"
        "print(lightning_paro.__file__)\n"
        "print(package_config_dir())\n"
        "print(sorted(k for k in StrategyRegistry if k.startswith('paro')))\n"
        "t = L.Trainer(strategy='paro_iig', accelerator='cpu', devices=1, logger=False)\n"
        "print(type(t.strategy).__name__, t.strategy.sharding.name)\n"
    )
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, env=_user_env(venv),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    where, conf, names, built_strategy = proc.stdout.strip().splitlines()[-4:]
    assert where.startswith(str(venv)) and conf.startswith(str(venv))  # the installed copy, not the source tree
    assert len(eval(names)) == 15  # "paro" and the 14 strategies
    assert built_strategy == "PaROStrategy IIG"


def readme_walkthrough() -> tuple[dict[str, str], list[str]]:
    """The README's walkthrough: files (a fenced block right after a line naming its path, as `PATH`:) and commands
    (the lines of its bash blocks)."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- walkthrough: start.*?-->(.*?)<!-- walkthrough: end -->", text, re.S)
    assert section, "README.md has no walkthrough section"
    files = {path: body for path, body in re.findall(r"^`([\w./-]+)`:\n\n```\w+\n(.*?)```", section.group(1),
                                                       re.S | re.M)}
    commands = [line for body in re.findall(r"```bash\n(.*?)```", section.group(1), re.S)
                for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return files, commands


@pytest.mark.timeout(420)
def test_the_readme_walkthrough_runs_verbatim_from_the_installed_wheel(venv, tmp_path):
    files, commands = readme_walkthrough()
    assert set(files) == {"mymodel.py", "configs/model/regressor.yaml", "configs/data/noisy_linear.yaml",
                          "configs/experiment/regressor.yaml"}
    assert [c.split()[:2] for c in commands] == [["lightning-paro", "fit"], ["lightning-paro", "predict"],
                                                 ["python", "-c"], ["lightning-paro", "bench"]]
    project = tmp_path / "project"  # unrelated to the checkout
    for name, body in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(body)
    env = _user_env(venv)
    outputs = []
    for command in commands:
        done = run_cli([], project, timeout=200, prefix=shlex.split(command), env=env)
        assert done.returncode == 0, f"{command}\n{done.describe()}"
        outputs.append(done.stdout)
    fit_out, predict_out, pandas_out, bench_out = outputs

    run = project / "runs" / "regressor"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "paro IIG" and summary["world_size"] == 2 and summary["optimizer_steps"] == 20
    assert summary["model"] == "mymodel.Regressor" and summary["loss_per_step_rank0"][-1] < summary[
        "loss_per_step_rank0"][0]
    assert "val_loss" in summary["validation"] and summary["intra_bytes_per_step"] > 0  # sharded in the group
    assert "PaRO strategy IIG" in fit_out
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"step=10.ckpt", "step=20.ckpt", "last.ckpt"}
    # PaRO's checkpoints are sharded directories, the library's default (README: sharded checkpoints where a file is
    # expected)
    assert (run / "weights.ckpt").is_dir() and "_target_: mymodel.Regressor" in (run / "config.yaml").read_text()

    import pandas as pd
    import pyarrow.parquet as pq

    frame = pd.read_parquet(run / "predictions").sort_values("row_id")
    assert list(frame.columns) == ["row_id", "prediction", "target"] and len(frame) == 1024
    assert pq.read_table(run / "predictions").num_rows == 1024
    assert "predicted 1024 rows with last.ckpt" in predict_out and "1024" in pandas_out
    # the predictions are the checkpoint's: a clearly better fit than predicting zero
    assert ((frame.prediction - frame.target) ** 2).mean() < 0.5 * (frame.target ** 2).mean()

    sweep = json.loads((project / "runs" / "compare" / "sweep.json").read_text())
    assert [job["overrides"] for job in sweep["jobs"]] == [["strategy=paro_iig"], ["strategy=ddp"]]
    assert [job["exit_code"] for job in sweep["jobs"]] == [0, 0]
    results = [job["result"] for job in sweep["jobs"]]
    assert [r["strategy"] for r in results] == ["paro IIG", "ddp"]
    # batch 32 x accumulation 2 x 2 ranks
    assert all(r["samples_per_s"] > 0 and r["samples_per_step"] == 32 * 2 * 2 for r in results)
    assert "samples/s" in bench_out
