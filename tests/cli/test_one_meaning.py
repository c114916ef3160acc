"""One meaning per name and nothing silently ignored: ``"paro"`` is ``PaROStrategy()`` in Python, in Lightning's
registry and on the command line; an option the chosen configuration never reads is an error naming it (in Python
and on the command line, before anything starts); an experiment written for PaRO runs beside ``ddp`` in one sweep;
``fit`` resumes from ``ckpt_path``; the package's classes, imports and checkpoint helpers behave as README says.
In-process, nothing launched (the resumed fit is in test_cli_end_to_end.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_paro
from lightning_paro import AutoConfig, PaROStrategy
from lightning_paro.cli.build import build_model, build_strategy
from lightning_paro.cli.checks import resume_path
from lightning_paro.cli.compose import load_config
from lightning_paro.cli.main import main
from lightning_paro.cli.schema import ConfigError
from lightning_paro.cli.sweep import plan_sweep
from lightning_paro.strategy.options import OptionError, PaROOptions

REPO = Path(__file__).resolve().parents[2]
FOUR_CPUS = ["trainer.accelerator=cpu", "trainer.devices=4"]


# ------------------------------------------------------------------------------------------------ one meaning
@pytest.mark.parametrize("name", ["paro", "paro_iig", "paro_nng", "paro_ggg"])
def test_a_strategy_name_means_the_same_in_python_the_registry_and_the_command_line(name):
    registered = StrategyRegistry[name]
    from_registry = registered["strategy"](**registered["init_params"]).options
    on_the_command_line = build_strategy(load_config([f"strategy={name}", *FOUR_CPUS])).options
    assert on_the_command_line == from_registry
    if name == "paro":
        assert from_registry == PaROStrategy().options == PaROOptions()
        assert from_registry.is_auto and from_registry.state_dict_type == "sharded"
    else:
        assert from_registry == PaROOptions(sharding=name[-3:].upper())


def test_the_readme_s_auto_example_runs_auto_with_its_options():
    cfg = load_config(["strategy=paro", "strategy.memory_budget=0.6", "strategy.replan_after_steps=0", *FOUR_CPUS])
    options = build_strategy(cfg).options
    assert options.is_auto
    assert (options.auto_config.memory_budget, options.auto_config.replan_after_steps) == (0.6, 0)
    assert "strategy.memory_budget=0.6 strategy.replan_after_steps=0" in (REPO / "README.md").read_text()


# ------------------------------------------------------------------------------------------------ nothing ignored
PYTHON_IGNORED = [
    (dict(sharding="IIG", auto=AutoConfig(memory_budget=0.6)), "auto", "sharding='auto'"),
    (dict(sharding="NIG", gather="sharded"), "gather", "drop gather="),
    (dict(sharding="NNG", prefetch=2), "prefetch", "drop prefetch="),
    (dict(sharding="NNN", param_dtype="bf16"), "param_dtype", "drop param_dtype="),
    (dict(sharding="IIG", error_feedback=True), "error_feedback", "inter_quant='int8'"),
]


@pytest.mark.parametrize("kwargs,option,fix", PYTHON_IGNORED, ids=[p[1] for p in PYTHON_IGNORED])
def test_an_option_the_configuration_never_reads_is_refused_by_the_library(kwargs, option, fix):
    with pytest.raises(OptionError) as info:
        PaROStrategy(**kwargs)
    assert info.value.option == option and fix in str(info.value)


def test_the_same_options_are_accepted_where_they_apply():
    PaROStrategy(auto=AutoConfig(memory_budget=0.6), gather="sharded", prefetch=2, param_dtype="bf16")  # auto
    PaROStrategy(sharding="IIG", gather="sharded", prefetch=2)
    PaROStrategy(sharding="NNG", param_dtype="bf16", inter_quant="int8", error_feedback=True)


CLI_IGNORED = [
    (["strategy=paro_iig", "strategy.memory_budget=0.6"], "strategy.memory_budget", "strategy=paro"),
    (["strategy=paro", "strategy.sharding=NIG", "strategy.replan_after_steps=0"], "strategy.replan_after_steps",
     "option of sharding=auto"),
    (["strategy=paro_nnn", "strategy.intra_gbps=10", "strategy.inter_gbps=1"], "strategy.intra_gbps",
     "would be ignored"),
    (["strategy=paro_nig", "strategy.gather=sharded"], "strategy.gather", "P = I or G"),
    (["strategy=paro_nng", "strategy.prefetch=0"], "strategy.prefetch", "nothing is gathered"),
    (["strategy=paro_iig", "strategy.error_feedback=true"], "strategy.error_feedback", "int8"),
    (["strategy=paro", "strategy.intra_overlap=0.2"], "strategy.intra_overlap", "strategy.intra_gbps"),
    (["strategy=fsdp2", "strategy.group_size=2"], "strategy.group_size", "strategy=hsdp"),
]


@pytest.mark.parametrize("overrides,key,hint", CLI_IGNORED, ids=[c[1] for c in CLI_IGNORED])
def test_an_option_the_configuration_never_reads_is_one_line_on_the_command_line(overrides, key, hint, capsys):
    with pytest.raises(ConfigError) as info:
        load_config([*overrides, *FOUR_CPUS])
    assert info.value.key == key and hint in str(info.value)
    assert main(["fit", *overrides, *FOUR_CPUS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lightning-paro: error: {key}: "), err


# ------------------------------------------------------------------------------------------------ sweeps
def test_an_experiment_that_sets_a_paro_key_sweeps_against_ddp(tmp_path, capsys):
    jobs = plan_sweep(["experiment=demo", "strategy=paro_iig,ddp", f"run.dir={tmp_path}"])
    assert [job.swept for job in jobs] == [("strategy=paro_iig",), ("strategy=ddp",)]
    paro, ddp = (load_config(list(job.overrides)) for job in jobs)
    assert paro.strategy.group_size == 2 and paro.left_out == ()
    assert ddp.strategy.name == "ddp" and ddp.left_out == ("strategy.group_size=2",)
    # fsdp2 reads no group_size either (hsdp does)
    fsdp2 = load_config(["experiment=demo", "strategy=fsdp2"])
    assert fsdp2.strategy.group_size is None and fsdp2.left_out == ("strategy.group_size=2",)
    assert load_config(["experiment=demo", "strategy=hsdp"]).strategy.group_size == 2
    # the job says what it left out, once
    assert main(["bench", "--cfg", "job", "experiment=demo", "strategy=ddp"]) == 0
    out = capsys.readouterr().out
    assert out.count("note: strategy=ddp has no strategy.group_size=2") == 1 and "group_size" not in out.split(
        "left out", 1)[1]


def test_a_key_given_for_the_wrong_strategy_names_the_job_and_the_key(tmp_path, capsys):
    argv = ["bench", "-m", "experiment=demo", "strategy=paro_iig,ddp", "strategy.group_size=2", f"run.dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "lightning-paro: error: job 2 of 2 (strategy=ddp): strategy.group_size: unknown key"), err
    assert not any(tmp_path.iterdir())  # refused before any job ran


# ------------------------------------------------------------------------------------------------ resuming
def test_ckpt_path_is_resolved_before_anything_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="ckpt_path: last: no last.*ckpt in .*checkpoints"):
        load_config(["ckpt_path=last", f"run.dir={run_dir}", "callbacks=checkpoint"])
    with pytest.raises(ConfigError, match="ckpt_path: .*nope.ckpt does not exist"):
        load_config([f"ckpt_path={tmp_path}/nope.ckpt"])
    (run_dir / "checkpoints").mkdir(parents=True)
    older, newer = run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "last-v1.ckpt"
    older.write_bytes(b"x")
    newer.mkdir()  # a sharded checkpoint is a directory
    import os

    os.utime(older, (1, 1))
    cfg = load_config(["ckpt_path=last", f"run.dir={run_dir}", "callbacks=checkpoint"])
    assert resume_path(cfg) == newer
    assert resume_path(load_config([f"ckpt_path={older}"])) == older
    assert resume_path(load_config([])) is None
    assert main(["predict", f"ckpt_path={older}"]) == 2
    assert "ckpt_path: resumes fit only" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ type errors
def test_a_value_of_the_wrong_type_for_a_user_model_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "typed_user_model.py").write_text(
        "import lightning as L\nimport torch\n\n\nclass Net(L.LightningModule):\n"
        "    def __init__(self, hidden: int = 4):\n        super().__init__()\n"
        "        self.layer = torch.nn.Linear(hidden, 1)\n\n\n"
        "class Untyped(L.LightningModule):\n    def __init__(self, hidden=4):\n        super().__init__()\n"
        "        self.layer = torch.nn.Linear(hidden, 1)\n")
    (tmp_path / "configs" / "model").mkdir(parents=True)
    for name in ("Net", "Untyped"):
        (tmp_path / "configs" / "model" / f"{name.lower()}.yaml").write_text(
            f"_target_: typed_user_model.{name}\nhidden: 4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    base = ["--config-dir", "configs", "~data", "trainer.accelerator=cpu", "trainer.devices=1",
            f"run.dir={tmp_path}/run"]
    assert main(["fit", "model=net", "model.hidden=abc", *base]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "lightning-paro: error: model.hidden: 'abc' is not int: typed_user_model.Net takes hidden: int"]
    # no annotation: the TypeError the class raises, in one line
    assert main(["fit", "model=untyped", "model.hidden=abc", *base]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-paro: error: model: typed_user_model.Untyped: "), err


# ------------------------------------------------------------------------------------------------ package surface
def test_every_package_class_the_readme_calls_is_importable_from_the_package():
    import lightning_paro.planner
    import lightning_paro.predict

    text = (REPO / "README.md").read_text().split("\n## Layout")[0]
    called = set(re.findall(r"\b([A-Z][A-Za-z0-9]+)\(", text))
    ours = {name for name in called for module in (lightning_paro.planner, lightning_paro.predict)
            if isinstance(getattr(module, name, None), type)} | {"PaROStrategy", "GatherConfig"}
    assert {"AutoConfig", "ElasticPredict", "PaROStrategy"} <= ours
    for name in ours:
        assert getattr(lightning_paro, name) is not None
        assert name in lightning_paro.__all__


def test_no_warning_of_the_package_s_own_at_import_or_from_the_compat_table():
    # running the table imports the package first (its import warnings would show too), then runs the table: with
    # compat a plain module already imported by the package, Python warned that it found it in sys.modules
    import os

    done = subprocess.run([sys.executable, "-W", "always", "-m", "lightning_paro.compat"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "always"}, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "lightning_paro" not in done.stderr, done.stderr
    assert "ok      [strategy]" in done.stdout


def test_the_walkthrough_s_pandas_comes_with_the_install_it_names():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("pandas") for d in extras["predict"])
    walkthrough = (REPO / "README.md").read_text().split("<!-- walkthrough: start")[1]
    assert 'pip install "lightning-paro[predict]"' in walkthrough.split("import pandas")[0]


# ------------------------------------------------------------------------------------------------ sharded checkpoints
def _sharded_checkpoint(directory: Path, model: torch.nn.Module) -> None:
    """A sharded checkpoint as PaROStrategy writes one (torch.distributed.checkpoint + meta.pt), in one process."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": model.state_dict()}, checkpoint_id=str(directory))
    torch.save({"global_step": 3, "hyper_parameters": dict(model.hparams),
                "pytorch-lightning_version": "2.6.0"}, directory / "meta.pt")


def test_a_sharded_checkpoint_loads_where_one_file_is_expected(tmp_path, capsys):
    from lightning_paro.demo import GPTTask

    model = build_model(load_config(["model=gpt_tiny"]))
    directory = tmp_path / "x.ckpt"
    _sharded_checkpoint(directory, model)
    with pytest.raises(IsADirectoryError):  # Lightning's own loader opens files only
        GPTTask.load_from_checkpoint(directory)
    loaded = lightning_paro.load_from_checkpoint(GPTTask, directory)
    assert loaded.hparams["dim"] == model.hparams["dim"] == 32
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    # the converter writes the file that Lightning's loader opens; given a file, it says it has nothing to do
    from lightning_paro.convert import main as convert

    convert([str(directory), str(tmp_path / "x_full.ckpt")])
    again = GPTTask.load_from_checkpoint(tmp_path / "x_full.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    with pytest.raises(SystemExit, match="already one file"):
        convert([str(tmp_path / "x_full.ckpt"), str(tmp_path / "y.ckpt")])
    assert lightning_paro.load_checkpoint(directory)["global_step"] == 3
