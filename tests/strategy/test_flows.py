"""Acceptance: sequences of Trainer calls behave under PaRO as under "ddp".

One launch of 4 processes (2 groups of 2) runs every flow of ``workers/flows.py`` for "ddp" and for IIG and GGG with
sharded and with full checkpoints, and for GGG with full checkpoints whose evaluation and module after fit stay
sharded (``gather="sharded"``); each test below compares one flow with "ddp": losses, metrics, predictions, final
weights and checkpoint contents (sharded ones consolidated first) within 1e-5.
"""

import json
from pathlib import Path

import pytest
import torch
from launch import launch

from lightning_paro.strategy.checkpoint import convert_to_full, is_sharded_checkpoint
from lightning_paro.strategy.manual import ManualSteps, check_one_optimizer

WORLD, TOL = 4, 1e-5
SYSTEMS = ["IIG-sharded", "IIG-full", "GGG-sharded", "GGG-full", "GGG-full-sharded"]


@pytest.fixture(scope="module")
def flows(tmp_path_factory):
    out = tmp_path_factory.mktemp("flows")
    launch("flows.py", WORLD, str(out), ",".join(["ddp", *SYSTEMS]), timeout=480)

    class Runs:
        dir = out

        @staticmethod
        def result(flow, system, rank=0):
            res = json.loads((out / f"{flow}.{system}.{rank}.json").read_text())
            assert "error" not in res, f"{flow} under {system}, rank {rank}: {res['error']}"
            return res

        @staticmethod
        def weights(flow, system):
            return torch.load(out / f"{flow}.{system}.pt", weights_only=True)

    return Runs


def _close(got, want, path="", subst=None):
    """Recursive comparison of results: numbers and tensors within TOL, everything else equal (strings after
    replacing ``subst``'s keys, e.g. the system's directory by "ddp"'s)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        got = {_subst(k, subst): v for k, v in got.items()}
        assert got.keys() == want.keys(), f"{path}: {sorted(got)} vs {sorted(want)}"
        for k in want:
            _close(got[k], want[k], f"{path}.{k}", subst)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{path}: {got!r} vs {want!r}"
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, f"{path}[{i}]", subst)
    elif torch.is_tensor(want):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=path)
    elif isinstance(want, float) and not isinstance(got, str):
        assert got == pytest.approx(want, abs=TOL), path
    elif isinstance(want, str):
        assert _subst(got, subst) == want, path
    else:
        assert got == want, path


def _subst(value, subst):
    if isinstance(value, str):
        for a, b in (subst or {}).items():
            value = value.replace(a, b)
    return value


def _same_results(flows, flow, system, keys=None):
    for r in range(WORLD):
        got, want = flows.result(flow, system, r), flows.result(flow, "ddp", r)
        keys_here = keys or want.keys()
        _close({k: got[k] for k in keys_here}, {k: want[k] for k in keys_here}, f"{flow} {system} rank {r}",
               subst={f"/{system}/": "/ddp/"})


def _same_weights(flows, flow, system):
    got, want = flows.weights(flow, system), flows.weights(flow, "ddp")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=TOL, rtol=0, msg=f"{flow} {system}: {k}")


def _full(path: Path, tmp: Path) -> dict:
    if is_sharded_checkpoint(path):
        return torch.load(convert_to_full(path, tmp / f"{path.parent.name}-{path.name}.full"), weights_only=True)
    assert path.is_file(), path
    return torch.load(path, weights_only=True)


def _same_checkpoint(got_path: Path, want_path: Path, system: str, tmp: Path, subst=None) -> None:
    """The checkpoint holds what "ddp"'s holds: weights, optimizer states, schedulers, loops, counters, callbacks."""
    kind = system.split("-")[1]
    assert is_sharded_checkpoint(got_path) if kind == "sharded" else got_path.is_file(), got_path
    got, want = _full(got_path, tmp), _full(want_path, tmp)
    assert got.keys() == want.keys()
    for key in want:
        if key != "optimizer_states":
            _close(got[key], want[key], key, subst)
    assert len(got["optimizer_states"]) == len(want["optimizer_states"]) == 1
    got_opt, want_opt = got["optimizer_states"][0], want["optimizer_states"][0]
    _close(got_opt["param_groups"], want_opt["param_groups"], "param_groups")
    _close({k: got_opt["state"][k] for k in want_opt["state"]}, want_opt["state"], "optimizer state")
    # A parameter no step used has no state under "ddp"; here it shares a flat shard, so it has inert zeros.
    for k in got_opt["state"].keys() - want_opt["state"].keys():
        assert all(not v.any() for n, v in got_opt["state"][k].items() if n != "step"), k


# ---------------------------------------------------------------------- fit, then evaluate, then save
@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("flow,stage", [("fit_validate_save", "val"), ("fit_test_save", "test")])
def test_save_checkpoint_after_fit_and_evaluation(flows, tmp_path, flow, stage, system):
    """fit -> validate (or test) -> save_checkpoint: the evaluation keeps the fit's optimizer shards, so the
    checkpoint holds them, as "ddp"'s does."""
    _same_results(flows, flow, system)
    _same_weights(flows, flow, system)
    res = flows.result(flow, system)
    assert res[stage][f"{stage}_loss"] > 0
    _same_checkpoint(Path(res["ckpt"]), Path(flows.result(flow, "ddp")["ckpt"]), system, tmp_path)


@pytest.mark.timeout(600)
# Not under gather="sharded": a module left sharded after fit has no parameter values to change.
@pytest.mark.parametrize("system", [s for s in SYSTEMS if s != "GGG-full-sharded"])
def test_module_changed_between_stages(flows, tmp_path, system):
    """After fit, the module's parameters get storage of their own, then other weights are loaded into it: validate,
    test and the checkpoint (with the fit's optimizer states) see the module as it is, as under "ddp"."""
    _same_results(flows, "change_between_stages", system)
    _same_weights(flows, "change_between_stages", system)
    res = flows.result("change_between_stages", system)
    assert res["val"]["val_loss"] == pytest.approx(flows.result("fit_validate_save", system)["val"]["val_loss"],
                                                   abs=TOL)
    _same_checkpoint(Path(res["ckpt"]), Path(flows.result("change_between_stages", "ddp")["ckpt"]), system, tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_layers_built_in_configure_model(flows, tmp_path, system):
    """configure_model runs at every stage; built once (it returns early when the layers exist), fit -> validate ->
    save_checkpoint -> fit again behaves as under "ddp"."""
    _same_results(flows, "configure_model", system)
    assert len(flows.result("configure_model", system)["losses"]) == 4
    _same_weights(flows, "configure_model", system)
    res = flows.result("configure_model", system)
    _same_checkpoint(Path(res["ckpt"]), Path(flows.result("configure_model", "ddp")["ckpt"]), system, tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_fit_predict_fit_again(flows, system):
    """fit (2 steps) -> predict -> fit on the same Trainer with max_steps raised to 4: it continues to step 4 as
    "ddp" does (new optimizer from configure_optimizers), and the predictions match."""
    _same_results(flows, "fit_predict_fit", system)
    res = flows.result("fit_predict_fit", system)
    assert res["first_fit"] == 2 and res["global_step"] == 4 and len(res["losses"]) == 4
    _same_weights(flows, "fit_predict_fit", system)
    for r in range(WORLD):
        got = torch.load(flows.dir / "fit_predict_fit" / system / f"preds.{r}.pt", weights_only=True)
        want = torch.load(flows.dir / "fit_predict_fit" / "ddp" / f"preds.{r}.pt", weights_only=True)
        _close(got, want, f"predictions rank {r}")
        assert len(got) == 2 and got[0].shape == (2, 8, 37)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_validate_and_test_alone_on_a_fresh_trainer(flows, system):
    """validate and test on fresh Trainers, with the module's own weights and with ckpt_path (this system's
    sharded directory or full file): the metrics "ddp" gets, and with a checkpoint the ones measured right after the
    fit that saved it."""
    _same_results(flows, "eval_fresh", system)
    res = flows.result("eval_fresh", system)
    assert res["validate-ckpt"]["val_loss"] == pytest.approx(
        flows.result("fit_validate_save", system)["val"]["val_loss"], abs=TOL)
    assert res["test-ckpt"]["test_loss"] == pytest.approx(
        flows.result("fit_test_save", system)["test"]["test_loss"], abs=TOL)
    assert abs(res["validate"]["val_loss"] - res["validate-ckpt"]["val_loss"]) > 0.1  # the checkpoint was read


# ---------------------------------------------------------------------- callbacks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_model_checkpoint_top_k_last_and_best(flows, system):
    """ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True, every_n_train_steps=2) over 8 steps keeps
    the same checkpoints as under "ddp" (step 4's, no longer in the top 2, removed: a sharded one as a directory), and
    validate(ckpt_path="best") and test(ckpt_path="last") read them."""
    _same_results(flows, "callbacks", system, ["losses", "listing", "best", "best_score", "last", "best_k",
                                               "validate-best", "test-last"])
    res = flows.result("callbacks", system)
    assert res["listing"] == ["last.ckpt", "step=6.ckpt", "step=8.ckpt"]
    assert res["validate-best"]["val_loss"] == pytest.approx(res["best_score"], abs=TOL)
    kind = "sharded" if system.split("-")[1] == "sharded" else "file"
    assert res["kinds"] == {name: kind for name in res["listing"]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_resume_from_last_checkpoint(flows, tmp_path, system):
    """A new Trainer and model fit(ckpt_path="last") from step 8 to 10: the same losses, weights and last
    checkpoint as "ddp"."""
    _same_results(flows, "callbacks", system, ["resumed_losses", "resumed_global_step"])
    assert flows.result("callbacks", system)["resumed_global_step"] == 10
    _same_weights(flows, "callbacks", system)
    base = flows.dir / "callbacks"
    _same_checkpoint(base / system / "ckpts" / "last.ckpt", base / "ddp" / "ckpts" / "last.ckpt", system, tmp_path,
                     subst={f"/{system}/": "/ddp/"})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_learning_rate_monitor_and_per_step_schedule(flows, system):
    """LearningRateMonitor logs, into a CSVLogger, the learning rates of both param groups at every step; the step
    schedule halves them every 2 steps, as under "ddp"."""
    got, want = flows.result("callbacks", system)["lr"], flows.result("callbacks", "ddp")["lr"]
    _close(got, want, "lr")
    assert [row["step"] for row in got] == list(range(8))
    assert [row["lr-AdamW/pg1"] for row in got] == pytest.approx([0.01 * 0.5 ** (s // 2) for s in range(8)])
    assert all(row["lr-AdamW/pg2"] == row["lr-AdamW/pg1"] for row in got)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_early_stopping(flows, system):
    """EarlyStopping(patience=1, min_delta=5) stops at the second validation (step 4 of 12), as under "ddp"."""
    _same_results(flows, "early_stopping", system)
    res = flows.result("early_stopping", system)
    assert res["global_step"] == 4 and res["should_stop"]
    _same_weights(flows, "early_stopping", system)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_per_epoch_schedule(flows, system):
    """A StepLR stepped per epoch: two epochs leave the learning rate at a quarter, losses and weights as "ddp"."""
    _same_results(flows, "epoch_schedule", system)
    assert flows.result("epoch_schedule", system)["lr"] == pytest.approx([0.0025, 0.0025])
    _same_weights(flows, "epoch_schedule", system)


# ---------------------------------------------------------------------- several fits in one process
@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_one_module_fitted_by_two_trainers(flows, system):
    _same_results(flows, "two_trainers", system)
    assert len(flows.result("two_trainers", system)["losses"]) == 4
    _same_weights(flows, "two_trainers", system)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_fit_after_fit_in_one_process(flows, system):
    """A sweep: new model, Trainer and strategy for each fit."""
    _same_results(flows, "sweep", system)
    res = flows.result("sweep", system)
    assert res["losses2"] != res["losses3"]
    _same_weights(flows, "sweep", system)


# ---------------------------------------------------------------------- manual optimization, several optimizers
@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("flow", ["manual", "manual_accumulate"])
def test_manual_optimization(flows, flow, system):
    """automatic_optimization=False with one optimizer: two forward/manual_backward pairs per batch and a step per
    batch ("manual"), or one per batch and a step every 2 batches ("manual_accumulate"); clip_gradients by norm
    before each step. Losses and weights as under "ddp"."""
    _same_results(flows, flow, system)
    assert len(flows.result(flow, system)["losses"]) == (6 if flow == "manual" else 4)
    _same_weights(flows, flow, system)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_several_optimizers_fail_before_training(flows, system):
    assert flows.result("two_optimizers", "ddp")["raised"] is None  # the module trains under "ddp"
    for r in range(WORLD):
        res = flows.result("two_optimizers", system, r)
        assert res["losses"] == []
        assert res["raised"].startswith("ValueError: The PaRO strategy trains one optimizer; configure_optimizers"
                                        " returned 2 (Adam, SGD).")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", SYSTEMS)
def test_manual_backward_after_clip_fails_naming_the_order(flows, system):
    """Clipping brings the gradients to the optimizer shards, after which another backward could not be added to
    them correctly: a manual_backward between clip_gradients and the step (which "ddp" allows) raises instead, on
    every rank, before the step."""
    assert flows.result("backward_after_clip", "ddp")["raised"] is None
    for r in range(WORLD):
        res = flows.result("backward_after_clip", system, r)
        assert res["losses"] == []
        assert res["raised"].startswith("RuntimeError: manual_backward ran after clip_gradients and before the"
                                        " optimizer step")


def test_check_one_optimizer_names_the_optimizers():
    params = [torch.nn.Parameter(torch.zeros(2))]
    check_one_optimizer([torch.optim.SGD(params, lr=0.1)])
    with pytest.raises(ValueError, match=r"returned 2 \(SGD, Adam\)\. Put the parameters in one optimizer"):
        check_one_optimizer([torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params)])



class _Calls:
    """Stands in for the engine: records which step-protocol calls ManualSteps makes."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda **kwargs: self.calls.append((name, kwargs) if kwargs else name)


def test_manual_steps_sync_once_before_the_step_however_many_backwards():
    engine = _Calls()
    steps = ManualSteps(engine)
    for _ in range(2):
        steps.before_backward()
        steps.after_backward()
    steps.before_step()  # a clip
    steps.before_step()  # the step: the gradients are there already
    steps.after_step()
    steps.before_step()  # a step without a backward: nothing to sync
    assert engine.calls == [("finish_backward", {"sync": False}), "prepare_next_forward",
                            ("finish_backward", {"sync": False}), "prepare_next_forward",
                            "sync_grads", "prepare_next_forward"]


def test_manual_steps_refuse_a_backward_between_clip_and_step():
    engine = _Calls()
    steps = ManualSteps(engine)
    steps.before_backward()
    steps.after_backward()
    steps.before_step()
    with pytest.raises(RuntimeError, match="manual_backward ran after clip_gradients and before the optimizer step"):
        steps.before_backward()  # before the backward issues any collective
    assert engine.calls[-1] == "sync_grads"
