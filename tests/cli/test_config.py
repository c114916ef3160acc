"""The config tree composes with Hydra's compose API, every strategy config builds its strategy, every PaRO knob is
overridable, every option of the other groups builds its objects, users' own config directories add options, and bad
values come back as one line naming the key. In-process: nothing is launched."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_paro import PaROStrategy, VALID_STRATEGIES
from lightning_paro.cli import schema
from lightning_paro.cli.build import FSDP2Strategy, build_data, build_model, build_strategy, build_trainer
from lightning_paro.cli.compose import SETTINGS_SCHEMAS, group_options, load_config, package_config_dir
from lightning_paro.cli.main import main, parse_args
from lightning_paro.cli.schema import ConfigError
from lightning_paro.demo.model import Block
from lightning_paro.strategy.transitions import CommDtypes

CONF = package_config_dir()
REPO = Path(__file__).resolve().parents[2]
STRATEGY_CONFIGS = group_options()["strategy"]
FOUR_CPUS = ["trainer.accelerator=cpu", "trainer.devices=4"]


def test_the_config_tree_has_every_paro_strategy_and_the_baselines():
    expected = {"paro", "ddp", "fsdp2", "hsdp"} | {f"paro_{s.lower()}" for s in VALID_STRATEGIES}
    assert set(STRATEGY_CONFIGS) == expected


@pytest.mark.parametrize("name", STRATEGY_CONFIGS)
def test_every_strategy_config_composes_and_builds_its_strategy(name):
    cfg = load_config([f"strategy={name}", *FOUR_CPUS])
    strategy = build_strategy(cfg)
    if name.startswith("paro"):
        assert type(strategy) is PaROStrategy
        assert strategy.options.sharding == ("auto" if name == "paro" else name[-3:].upper())
        assert strategy._group_size is None and strategy._start_method == "popen"
    elif name == "ddp":
        assert type(strategy) is DDPStrategy
    else:
        assert type(strategy) is FSDP2Strategy
        assert strategy._data_parallel_size == 4 and strategy._tensor_parallel_size == 1
        # fsdp2 shards over all ranks; hsdp defaults its shard group to the processes per node
        assert strategy.group_size == (None if name == "fsdp2" else 4)


def test_every_paro_knob_is_overridable():
    cfg = load_config(["strategy=paro", "strategy.sharding=iig", "strategy.group_size=2", "strategy.prefetch=0",
                       "strategy.log_traffic=false", "strategy.units=[lightning_paro.demo.model.Block]",
                       "strategy.start_method=spawn", "strategy.process_group_backend=gloo", "strategy.timeout_s=60",
                       "strategy.param_dtype=bf16", "strategy.reduce_dtype=fp32", "strategy.inter_quant=int8",
                       *FOUR_CPUS])
    s = build_strategy(cfg)
    assert s.options.comm_dtypes == CommDtypes(torch.bfloat16, torch.float32, "int8")
    assert s.sharding.name == "IIG" and s._group_size == 2 and s._prefetch == 0 and s._log_traffic is False
    assert s._units == [Block] and s._start_method == "spawn" and s.process_group_backend == "gloo"
    assert s._timeout == timedelta(seconds=60)
    auto = build_strategy(load_config(["strategy=paro", "strategy.sharding=auto", "strategy.memory_budget=0.5",
                                       "strategy.micro_step_seconds=0.2", "strategy.intra_gbps=100",
                                       "strategy.inter_gbps=10", "strategy.intra_overlap=0.25",
                                       "strategy.replan_after_steps=6", "strategy.replan_margin=0.2",
                                       "strategy.trial_margin=0", "strategy.first_plan=nng", "strategy.strategies=[NNG,IIG]", *FOUR_CPUS]))
    a = auto.options.auto_config
    assert a.memory_budget == 0.5 and a.micro_step_seconds == 0.2
    assert (a.replan_after_steps, a.replan_margin, a.first_plan, a.strategies) == (6, 0.2, "NNG", ("NNG", "IIG"))
    assert a.trial_margin == 0
    assert a.intra.bandwidth == 100e9 / 8 and a.inter.bandwidth == 10e9 / 8
    assert a.intra.overlap == 0.25 and a.inter.overlap == 1.0


def test_the_gather_mode_is_a_strategy_key():
    assert build_strategy(load_config(["strategy=paro", *FOUR_CPUS])).gather.evaluation == "auto"
    s = build_strategy(load_config(["strategy=paro_ggg", "strategy.gather=sharded", *FOUR_CPUS]))
    assert (s.gather.evaluation, s.gather.after_fit) == ("sharded", "sharded")
    with pytest.raises(ConfigError, match="strategy.gather: 'some' is not auto, full or sharded"):
        load_config(["strategy=paro", "strategy.gather=some", *FOUR_CPUS])


def test_a_per_strategy_file_is_the_paro_config_with_its_sharding():
    assert load_config(["strategy=paro_ggg"]).strategy == dataclasses.replace(
        load_config(["strategy=paro", "strategy.sharding=GGG"]).strategy)


def test_the_trainer_gets_the_trainer_group_and_the_strategy():
    cfg = load_config(["strategy=paro_iig", "strategy.group_size=2", "trainer=cpu4", "trainer.max_steps=7",
                       "trainer.accumulate_grad_batches=3", "trainer.gradient_clip_val=0.5"])
    trainer = build_trainer(cfg)
    assert isinstance(trainer.strategy, PaROStrategy) and trainer.strategy.group_size == 2
    assert trainer.num_devices == 4 and trainer.num_nodes == 1 and trainer.max_steps == 7
    assert trainer.accumulate_grad_batches == 3 and trainer.gradient_clip_val == 0.5
    # validation runs once, after the last optimizer step, counted in micro-batches across epochs
    assert trainer.val_check_interval == 21 and trainer.check_val_every_n_epoch is None


def _options(group: str) -> list[str]:
    return group_options()[group]


def test_the_config_tree_is_the_package_s_and_the_repository_s_conf():
    assert CONF == REPO / "conf"
    # strategy and predict are stored from their dataclasses (no files)
    assert {p.name for p in CONF.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "model", "data", "trainer", "callbacks", "logger", "experiment"}
    assert set(group_options()) == {"strategy", "model", "data", "trainer", "callbacks", "logger", "predict",
                                    "experiment"}


@pytest.mark.parametrize("option", _options("model"))
def test_every_model_and_data_option_builds_a_lightning_module_and_datamodule(option):
    import lightning as L

    cfg = load_config([f"model={option}", "data=stdlib_tiny"])
    model = build_model(cfg)
    assert isinstance(model, L.LightningModule) and model.hparams["seq_len"] == cfg.model["seq_len"]
    for data in _options("data"):
        built = build_data(load_config([f"model={option}", f"data={data}"]))
        assert isinstance(built.datamodule, L.LightningDataModule) and built.datamodule.seq_len == cfg.model["seq_len"]


def test_every_callbacks_and_logger_option_builds_lightning_objects(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    cfg = load_config(["callbacks=[checkpoint,early_stopping]", "logger=[csv,tensorboard]", "trainer.devices=1",
                       "trainer.accelerator=cpu", f"run.dir={tmp_path}"])
    trainer = build_trainer(cfg)
    kinds = {type(c) for c in trainer.callbacks}
    assert {ModelCheckpoint, EarlyStopping} <= kinds and trainer.checkpoint_callback.dirpath == str(
        tmp_path / "checkpoints")
    assert [type(x) for x in trainer.loggers] == [CSVLogger, TensorBoardLogger]
    assert trainer.loggers[0].save_dir == str(tmp_path)
    for option in _options("callbacks") + _options("logger"):
        group = "callbacks" if option in _options("callbacks") else "logger"
        load_config([f"{group}={option}"])
    none = build_trainer(load_config(["logger=none", "trainer.devices=1", "trainer.accelerator=cpu"]))
    assert none.loggers == [] and not any(isinstance(c, ModelCheckpoint) for c in none.callbacks)


def test_settings_nodes_are_their_dataclasses():
    cfg = load_config(["experiment=demo"])
    for key, node_class in SETTINGS_SCHEMAS.items():
        assert isinstance(getattr(cfg, key), node_class)
    # the demo experiment: PaRO IIG on 4 CPU processes in 2 groups, its own run directory
    assert cfg.strategy.sharding == "IIG" and cfg.strategy.group_size == 2
    assert cfg.trainer["devices"] == 4 and cfg.run.dir.endswith("runs/demo")


def test_trainer_keys_pass_through_to_lightning():
    cfg = load_config(["trainer.devices=1", "trainer.accelerator=cpu", "+trainer.limit_train_batches=0.5",
                       "+trainer.reload_dataloaders_every_n_epochs=2", "trainer.enable_progress_bar=false"])
    trainer = build_trainer(cfg)
    assert trainer.limit_train_batches == 0.5 and trainer.reload_dataloaders_every_n_epochs == 2
    assert trainer.progress_bar_callback is None
    # an object argument as a _target_ node
    from lightning.pytorch.profilers import SimpleProfiler

    profiled = build_trainer(load_config(["trainer.devices=1", "trainer.accelerator=cpu",
                                           "+trainer.profiler._target_=lightning.pytorch.profilers.SimpleProfiler"]))
    assert isinstance(profiled.profiler, SimpleProfiler)


def test_the_step_progress_bar_replaces_lightning_s():
    from lightning_paro.cli.progress import StepProgressBar

    trainer = build_trainer(load_config(["trainer.devices=1", "trainer.accelerator=cpu"]))
    assert isinstance(trainer.progress_bar_callback, StepProgressBar)


def test_run_dir_is_absolute_against_the_working_directory(tmp_path):
    cfg = load_config(["run.name=exp1"], cwd=tmp_path)
    assert Path(cfg.run.dir) == tmp_path.resolve() / "runs" / "exp1"
    assert load_config([f"run.dir={tmp_path}/x"]).run.dir == str(tmp_path.resolve() / "x")
    # ${run.dir} elsewhere (a logger's directory) is the absolute one too
    assert cfg.logger["csv"]["save_dir"] == cfg.run.dir


BAD = [
    (["strategy.sharding=XYZ"], "strategy.sharding", "NIG"),
    (["strategy.sharding=NGI"], "strategy.sharding", "IIG"),
    (["strategy.group_size=3", "trainer.devices=4"], "strategy.group_size", "1, 2, 4"),
    (["strategy.group_size=2", "trainer.devices=3", "trainer.num_nodes=1"], "strategy.group_size", "1, 3"),
    (["strategy.group_size=0"], "strategy.group_size", "positive"),
    (["strategy=nope"], "strategy", "paro_nig"),
    (["model=nope"], "model", "gpt_tiny"),
    (["model=gpt_tny"], "model", "did you mean gpt_tiny"),
    (["experiment=nope"], "experiment", "choose one of demo"),
    (["stratgy=paro"], "stratgy", "strategy"),
    (["strategy.prefech=2"], "strategy.prefech", "prefetch"),
    (["strategy=ddp", "strategy.sharding=NIG"], "strategy.sharding", "find_unused_parameters"),
    (["+strategy.foo=1"], "strategy.foo", "sharding"),
    (["strategy.sharding=NIG,GGG"], "strategy.sharding", "-m"),
    (["strategy.start_method=thread"], "strategy.start_method", "spawn"),
    (["strategy.log_traffic=maybe"], "strategy.log_traffic", "bool"),
    (["trainer.devices=0"], "trainer.devices", "positive"),
    (["trainer.max_steps=abc"], "trainer.max_steps", "abc"),
    (["trainer.precision=16-mixed"], "trainer.precision", "bf16-mixed"),
    (["model._target_=nowhere.Model"], "model._target_", "cannot import 'nowhere.Model'"),
    (["model._target_=lightning_paro.demo.StdlibData"], "model._target_", "not a LightningModule"),
    (["+model.widht=3"], "model.widht", "GPTTask takes no argument 'widht'"),
    (["model.dim=abc"], "model.dim", "'abc' is not int: lightning_paro.demo.task.GPTTask takes dim: int"),
    (["model.trainable_blocks=x"], "model.trainable_blocks", "'x' is not int or None"),
    (["model.lyers=3"], "model.lyers", "did you mean layers? (its arguments are vocab, seq_len"),
    (["trainer.max_time=1"], "trainer.max_time", "trainer takes max_time but its config has no key for it: add it"
                                                  " with +trainer.max_time=VALUE"),
    (["~model", "~data"], "model", "model=NAME"),
    (["~model.seq_len"], "data.seq_len", "~data"),
    (["data._target_=torch.utils.data.Nope"], "data._target_", "cannot import"),
    (["+data.shuffle=true"], "data.shuffle", "StdlibData takes no argument 'shuffle'"),
    (["+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint", "+callbacks.ckpt.every=3"],
     "callbacks.ckpt.every", "ModelCheckpoint takes no argument 'every'"),
    (["+callbacks.x._target_=lightning_paro.demo.GPTTask"], "callbacks.x._target_", "not a Lightning Callback"),
    (["+logger.w._target_=lightning.pytorch.loggers.WandbLoger"], "logger.w._target_", "WandbLoger"),
    (["+trainer.max_epoch=3"], "trainer.max_epoch", "did you mean max_epochs"),
    (["+trainer.strategy=ddp"], "trainer.strategy", "strategy group"),
    (["+trainer.logger=false"], "trainer.logger", "logger=none"),
    (["trainer.max_steps=0"], "trainer.max_steps", "-1"),
    (["+trainer.profiler._target_=lightning.pytorch.profilers.SimpleProfiller"], "trainer.profiler._target_",
     "cannot import"),
    (["+experiment.trainer.devices=2"], "experiment", "@package _global_"),
    (["strategy.memory_budget=0"], "strategy.memory_budget", "share"),
    (["strategy.inter_gbps=10"], "strategy.intra_gbps", "both"),
    (["strategy.inter_overlap=2"], "strategy.inter_overlap", "[0, 1]"),
    (["strategy.param_dtype=fp16"], "strategy.param_dtype", "'bf16', 'fp32'"),
    (["strategy.inter_quant=int4"], "strategy.inter_quant", "'int8'"),
    (["predict.format=csv"], "predict.format", "parquet"),
    (["predict.fetch_threads=0"], "predict.fetch_threads", "positive"),
    (["predict.shard_sise=3"], "predict.shard_sise", "shard_size"),
    (["strategy=hsdp", "strategy.group_size=3", "trainer.devices=4"], "strategy.group_size", "divide"),
    (["hydra.run.dir=outputs/x"], "hydra.run.dir", "run.dir"),
    (["hydra.searchpath=[file:///nonexistent/dir]"], "hydra.searchpath", "not a directory"),
    (["hydra.job.chdir=true"], "hydra.job.chdir", "run.dir"),
]


@pytest.mark.parametrize("overrides,key,hint", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_bad_value_is_one_line_naming_the_key(overrides, key, hint, capsys):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert info.value.key == key and hint in str(info.value)
    assert main(["fit", *overrides]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lightning-paro: error: {key}: "), captured.err


@pytest.mark.parametrize("argv,key", [(["train"], "command"), ([], "command"), (["fit", "--bogus"], "--bogus"),
                                      (["fit", "--config-dir"], "--config-dir"), (["fit", "--cfg"], "--cfg"),
                                      (["fit", "--cfg", "hydra"], "--cfg"), (["fit", "--info"], "--info"),
                                      (["fit", "-cd", "a", "--config-dir=b"], "--config-dir")])
def test_a_bad_command_line_is_one_line(argv, key, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lightning-paro: error: {key}"), err


def test_a_missing_config_dir_is_one_line(tmp_path, capsys):
    assert main(["fit", "--config-dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--config-dir" in err[0] and "not a directory" in err[0]


USER_MODULE = """
import lightning as L
import torch


class TinyNet(L.LightningModule):
    def __init__(self, width: int, lr: float = 0.1):
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's project: a module with a LightningModule and a config directory with a model and an experiment."""
    (tmp_path / "user_models_for_config_tests.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    configs = tmp_path / "configs"
    (configs / "model").mkdir(parents=True)
    (configs / "experiment").mkdir()
    (configs / "model" / "tiny_net.yaml").write_text("_target_: user_models_for_config_tests.TinyNet\nwidth: 4\n")
    (configs / "experiment" / "quick.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny_net\n  - override /strategy: paro_nig\n"
        "model:\n  width: 7\ntrainer:\n  max_steps: 3\nrun:\n  name: quick\n")
    monkeypatch.chdir(tmp_path)
    return configs


def test_a_user_config_dir_adds_options_and_experiments(user_dir):
    cfg = load_config(["model=tiny_net", "~data"], [user_dir])
    assert cfg.model == {"_target_": "user_models_for_config_tests.TinyNet", "width": 4} and cfg.data is None
    assert build_model(cfg).layer.in_features == 4
    exp = load_config(["experiment=quick", "~data"], [user_dir])
    assert exp.model["width"] == 7 and exp.strategy.sharding == "NIG" and exp.trainer["max_steps"] == 3
    assert exp.run.dir == str(user_dir.parent.resolve() / "runs" / "quick")
    # the same through hydra.searchpath (relative to the working directory) and through the environment
    assert load_config(["hydra.searchpath=[file://configs]", "experiment=quick", "~data"]).model == exp.model
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LIGHTNING_PARO_CONFIG_DIR", str(user_dir))
        assert load_config(["experiment=quick", "~data"]).model == exp.model


def test_a_user_model_s_arguments_are_checked_against_its_class(user_dir, capsys):
    with pytest.raises(ConfigError) as info:
        load_config(["model=tiny_net", "~data", "~model.width"], [user_dir])
    assert info.value.key == "model.width" and "needs this argument" in str(info.value)
    assert main(["fit", "--config-dir", str(user_dir), "model=tiny_net", "~data", "+model.depth=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lightning-paro: error: model.depth: user_models_for_config_tests.TinyNet takes no argument"
                   " 'depth'; did you mean width? its arguments are width, lr"]


def test_a_user_file_the_package_would_hide_is_refused(user_dir):
    (user_dir / "model" / "gpt.yaml").write_text("_target_: user_models_for_config_tests.TinyNet\nwidth: 4\n")
    with pytest.raises(ConfigError, match="model=gpt, which takes precedence"):
        load_config([], [user_dir])
    (user_dir / "model" / "gpt.yaml").unlink()
    (user_dir / "config.yaml").write_text("defaults:\n  - _self_\n")
    with pytest.raises(ConfigError, match="experiment"):
        load_config([], [user_dir])


def test_a_value_the_model_refuses_is_one_line_before_anything_starts(tmp_path, capsys):
    argv = ["fit", "model.dim=30", "model.heads=4", "trainer.accelerator=cpu", "trainer.devices=1",
            f"run.dir={tmp_path}/run"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lightning-paro: error: model: lightning_paro.demo.GPTTask: dim=30 is not divisible by heads=4"]
    assert not (tmp_path / "run").exists()


def test_torchrun_layout_must_match_the_trainer_config():
    from lightning_paro.cli.checks import check_launch_environment

    cfg = load_config(["trainer.devices=2"])
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}
    with pytest.raises(ConfigError, match="trainer.devices=4"):
        check_launch_environment(cfg, torchrun)
    check_launch_environment(load_config(["trainer.devices=4"]), torchrun)
    with pytest.raises(ConfigError, match="trainer.num_nodes=2"):
        check_launch_environment(load_config(["trainer.devices=4"]), {**torchrun, "WORLD_SIZE": "8"})


def test_print_config_and_help(capsys):
    assert main(["fit", "--cfg", "job", "strategy=paro_nig", "strategy.group_size=2", "trainer=cpu4"]) == 0
    out = capsys.readouterr().out
    assert "sharding: NIG" in out and "group_size: 2" in out and "devices: 4" in out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "paro_nig" in out and "fsdp2" in out and "gpt_tiny" in out


def test_tab_completion_is_hydra_s_over_the_stored_options(monkeypatch, capsys):
    assert main(["-sc", "install=bash"]) == 0
    assert "hydra_bash_completion" in capsys.readouterr().out
    # the command word is no override; the paro_xyz options are the stored ones, the keys those of the chosen node
    monkeypatch.setenv("COMP_LINE", "lightning-paro fit strategy=paro_ni")
    assert main(["-sc", "query=bash"]) == 0
    assert capsys.readouterr().out.split() == ["strategy=paro_nig", "strategy=paro_nii"]
    monkeypatch.setenv("COMP_LINE", "lightning-paro bench experiment=demo strategy=ddp strategy.find")
    assert main(["-sc", "query=bash"]) == 0
    assert capsys.readouterr().out.split() == ["strategy.find_unused_parameters="]
    assert main(["-sc", "bogus=bash"]) == 2
    assert capsys.readouterr().err.startswith("lightning-paro: error: --shell-completion: ")


def test_a_ledger_password_is_never_printed_or_saved(capsys):
    from lightning_paro.cli.commands import config_yaml

    url = "postgresql://user:s3cret@db.example/jobs"
    assert main(["predict", "--cfg", "job", f"predict.ledger='{url}'"]) == 0
    printed = capsys.readouterr().out
    assert "s3cret" not in printed and "postgresql://user:***@db.example/jobs" in printed
    assert "s3cret" not in config_yaml(load_config([f"predict.ledger='{url}'"]))


def test_parse_args_keeps_overrides_in_order_and_flags_anywhere():
    # Hydra's own parser: its long and short flags, the command as the first word that is no override
    inv = parse_args(["-m", "bench", "strategy=paro", "--config-dir=/x", "strategy.sharding=NIG,GGG"])
    assert inv.command == "bench" and inv.multirun and inv.config_dirs == (Path("/x"),)
    assert inv.overrides == ("strategy=paro", "strategy.sharding=NIG,GGG")
    inv = parse_args(["~data", "-cd", "/y", "fit", "-c", "job", "+trainer.x=1"])
    assert inv.command == "fit" and inv.print_config and inv.config_dirs == (Path("/y"),)
    assert inv.overrides == ("~data", "+trainer.x=1") and not inv.multirun


def test_the_config_reference_documents_every_key():
    doc = (REPO / "docs" / "config.md").read_text()
    missing = [f"{group}.{f.name}" for group, cls in SETTINGS_SCHEMAS.items() for f in dataclasses.fields(cls)
               if f"`{group}.{f.name}`" not in doc]
    for cls in (schema.ParoStrategyConfig, schema.DDPStrategyConfig, schema.FSDP2StrategyConfig):
        missing += [f"strategy.{f.name}" for f in dataclasses.fields(cls) if f"`strategy.{f.name}`" not in doc]
    defaults = load_config([])
    for group in ("model", "data", "trainer"):
        missing += [f"{group}.{k}" for k in getattr(defaults, group) if f"`{group}.{k}`" not in doc]
    assert not missing, f"keys missing from docs/config.md: {missing}"
    for group in ("strategy", "model", "data", "trainer", "callbacks", "logger", "predict", "experiment"):
        for option in _options(group):
            assert re.search(rf"\b{option}\b", doc), f"{group}={option}"


def test_predict_options_are_elastic_predict_s():
    from lightning_paro.predict import ElasticPredictConfig

    options = {f.name for f in dataclasses.fields(ElasticPredictConfig)} - {"output_dir", "finalize"}
    assert set(schema.PredictConfig().elastic_options()) == options
    ElasticPredictConfig(output_dir="x", **load_config([]).predict.elastic_options())  # the defaults are valid


def test_predict_refuses_weights_of_another_shape_naming_the_keys(tmp_path):
    from lightning_paro.cli.commands import config_yaml, load_weights

    tiny = load_config(["model=gpt_tiny", f"run.dir={tmp_path}"])
    path = tmp_path / "w.ckpt"
    trained = build_model(tiny)
    torch.save({"state_dict": trained.state_dict()}, path)
    (tmp_path / "config.yaml").write_text(config_yaml(tiny))  # what fit writes beside its checkpoint
    fresh = build_model(tiny)
    load_weights(fresh, path, tiny)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), trained.state_dict().values()))
    default = load_config([])
    with pytest.raises(ConfigError) as info:
        load_weights(build_model(default), path, default)
    assert info.value.key == "model.seq_len" and "pass model.seq_len=32 model.dim=32 model.heads=2" in str(info.value)
    (tmp_path / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="does not fit model .lightning_paro.demo.GPTTask.: .*Missing key"):
        load_weights(build_model(default), path, default)
    with pytest.raises(ConfigError, match="predict.checkpoint"):
        load_weights(fresh, tmp_path / "missing.ckpt", tiny)


def test_predict_reads_a_sharded_checkpoint_directory(tmp_path):
    import torch.distributed.checkpoint as dcp

    from lightning_paro.cli.commands import read_checkpoint

    state = build_model(load_config(["model=gpt_tiny"])).state_dict()
    directory = tmp_path / "sharded.ckpt"
    dcp.save({"state_dict": state}, checkpoint_id=str(directory))
    torch.save({"global_step": 7}, directory / "meta.pt")
    loaded = read_checkpoint(directory)
    assert loaded["global_step"] == 7 and set(loaded["state_dict"]) == set(state)
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in state.items())


def test_a_trainer_lightning_refuses_is_one_line(tmp_path, capsys):
    # devices=auto is one CPU process, which a group of 3 cannot divide: found when Lightning builds the Trainer
    argv = ["fit", "trainer.accelerator=cpu", "trainer.devices=auto", "strategy.group_size=3", f"run.dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-paro: error: trainer: ") and "group_size=3" in err[0], err


def test_a_sweep_is_refused_under_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert main(["fit", "-m", "strategy.sharding=NIG,GGG"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-paro: error: -m: ") and "torchrun" in err[0]


def test_now_in_run_dir_is_the_launch_time_shared_by_every_rank(monkeypatch, tmp_path):
    # Lightning's launcher re-runs the command line in each rank, later: the launch time travels in the environment
    monkeypatch.setenv("LIGHTNING_PARO_LAUNCH_TIME", "1700000000.5")
    first = load_config(["run.dir=runs/${now:%Y-%m-%d_%H-%M-%S}"], cwd=tmp_path).run.dir
    second = load_config(["run.dir=runs/${now:%Y-%m-%d_%H-%M-%S}"], cwd=tmp_path).run.dir
    from datetime import datetime
    assert first == second == str(tmp_path.resolve() / "runs" / datetime.fromtimestamp(1700000000.5).strftime(
        "%Y-%m-%d_%H-%M-%S"))


def test_the_hierarchical_chunk_size_reaches_the_strategy():
    cfg = load_config(["strategy=paro_iig", "strategy.chunk_bytes=1048576"])
    assert build_strategy(cfg)._chunk_bytes == 1048576


def test_trainable_blocks_freezes_all_but_the_last_blocks_and_the_final_norm():
    model = build_model(load_config(["model=gpt_tiny", "model.layers=3", "model.trainable_blocks=1"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("blocks.2.", "ln_f.")) for n in trainable)
    assert {n for n, _ in model.named_parameters() if n.startswith("blocks.2.") or n.startswith("ln_f.")} == trainable
    everything = build_model(load_config(["model=gpt_tiny"]))
    assert all(p.requires_grad for p in everything.parameters())


def test_no_config_file_writes_a_default_of_a_typed_node():
    # the typed nodes' defaults have one home, their dataclasses: the stored options are those dataclasses, and no
    # file of the package's tree sets a key of them (an experiment sets a run's choices, which are no defaults)
    from omegaconf import OmegaConf

    typed = {"strategy", "predict", *SETTINGS_SCHEMAS, "ckpt_path"}
    for path in sorted(CONF.rglob("*.yaml")):
        if path.parent.name != "experiment":
            node = OmegaConf.to_container(OmegaConf.load(path))
            assert not typed & set(node or {}), f"{path.relative_to(CONF)} sets {typed & set(node)}"
    assert load_config([]).strategy == schema.ParoStrategyConfig()
    assert load_config(["strategy=ddp"]).strategy == schema.DDPStrategyConfig()
    assert load_config(["strategy=hsdp"]).strategy == schema.FSDP2StrategyConfig(name="hsdp")
    defaults = load_config([])
    assert (defaults.predict, defaults.bench, defaults.ckpt_path) == (schema.PredictConfig(), schema.BenchConfig(), None)
    assert defaults.run == dataclasses.replace(schema.RunConfig(), dir=str(Path.cwd() / "runs" / "default"))
    assert {name for name in STRATEGY_CONFIGS if name.startswith("paro_")} == {
        f"paro_{s.lower()}" for s in VALID_STRATEGIES}


def test_the_config_reference_tables_are_generated_from_the_dataclasses():
    from lightning_paro.cli.reference import TABLES, render, table

    doc = (REPO / "docs" / "config.md").read_text()
    assert all(f"<!-- keys: {name} -->" in doc for name in TABLES)
    assert "| `strategy.prefetch` | `1` | Units gathered ahead" in table("strategy/paro")
    assert render(doc) == doc, "docs/config.md's tables differ: python -m lightning_paro.cli.reference docs/config.md"


def test_version_names_the_package_and_the_hydra_it_runs_on(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("lightning-paro ") and "(Hydra 1." in out
