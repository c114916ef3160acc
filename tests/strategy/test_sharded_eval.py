"""Sharded evaluation and a module left sharded after fit, with a bound on each rank's gathered parameter bytes.

One launch of 4 processes (2 groups of 2) runs fit (with validation inside) -> validate -> predict -> save ->
export -> resume under "ddp" and under IIG and GGG with ``gather="full"`` and ``gather="sharded"``; validation and
predict batches are uneven across ranks, also inside a group. Under ``gather="sharded"`` the engine refuses any gather
past the root unit plus two other units (prefetch 1), which is below the full model; the outputs equal the full-gather
path's and "ddp"'s within 1e-5.
"""

import json

import pytest
import torch
import torch.distributed as dist
from launch import launch

from lightning_paro.strategy.strategy import GatherConfig, PaROStrategy

WORLD, TOL = 4, 1e-5
PARO = ["IIG-sharded", "GGG-sharded", "IIG-full", "GGG-full"]
STAGES = ["fit", "validate_mem", "predict_mem", "save_mem", "resume_mem"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_eval")
    launch("sharded_eval.py", WORLD, str(out), ",".join(["ddp", *PARO]), timeout=150)

    def result(system, rank):
        res = json.loads((out / f"{system}.{rank}.json").read_text())
        assert "error" not in res, f"{system}, rank {rank}: {res['error']}"
        return res

    result.dir = out
    return result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("system", PARO)
def test_same_numbers_as_ddp(runs, system):
    for r in range(WORLD):
        got, want = runs(system, r), runs("ddp", r)
        for key in ("losses", "resumed_losses"):
            assert got[key] == pytest.approx(want[key], abs=TOL), f"{key} rank {r}"
        for key in ("fit_val", "validate", "resumed_val"):
            assert got[key] == pytest.approx(want[key], abs=TOL), f"{key} rank {r}"
        assert got["num_preds"] == want["num_preds"] == (1 if r == 3 else 2)
        preds = torch.load(runs.dir / f"{system}.preds.{r}.pt", weights_only=True)
        for a, b in zip(preds, torch.load(runs.dir / f"ddp.preds.{r}.pt", weights_only=True), strict=True):
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    exported = torch.load(runs.dir / f"{system}.pt", weights_only=True)
    final = torch.load(runs.dir / "ddp.pt", weights_only=True)
    assert exported.keys() == final.keys()
    for k in final:
        torch.testing.assert_close(exported[k], final[k], atol=TOL, rtol=0, msg=k)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("system", ["IIG-sharded", "GGG-sharded"])
def test_gathered_bytes_stay_under_the_bound(runs, system):
    for r in range(WORLD):
        res = runs(system, r)
        for stage in STAGES:
            mem = res[stage]
            # the engine raised on any gather past the limit; the limit is below the full model
            assert mem["peak"] <= mem["limit"] < mem["full"], f"{stage} rank {r}: {mem}"
        # after fit the module stays sharded: nothing is left gathered
        assert res["fit"]["alive_after"] == 0 and res["save_mem"]["alive_after"] == 0


@pytest.mark.timeout(200)
@pytest.mark.parametrize("system", ["IIG-sharded", "GGG-sharded"])
def test_a_module_left_sharded_holds_each_ranks_pieces(runs, system):
    """After fit, validate, predict, a checkpoint and an export, the module left sharded holds in each parameter this
    rank's piece of it (saved as it is with ``torch.save``): the pieces of the ranks of one P scope, in the order of
    their shards, are the exported weights (a rank's shard at level G is number j * g + i, for rank j of group i of g
    groups)."""
    exported = torch.load(runs.dir / f"{system}.pt", weights_only=True)
    pieces = [torch.load(runs.dir / f"{system}.pieces.{r}.pt", weights_only=True) for r in range(WORLD)]
    scopes = [[0, 1], [2, 3]] if system.startswith("IIG") else [[0, 2, 1, 3]]
    for name, full in exported.items():
        if name not in pieces[0]:
            continue  # a buffer
        for scope in scopes:
            assert all(pieces[r][name].dim() == 1 for r in scope), name
            torch.testing.assert_close(torch.cat([pieces[r][name] for r in scope]), full.reshape(-1), rtol=0,
                                       atol=0, msg=name)


@pytest.mark.timeout(200)
def test_join_rounds(runs):
    """One round (one scalar all-reduce) per step of the slowest rank of the P scope, plus the last one that counts
    no rank running. Validation inside fit: 2, 1, 1, 1 batches, twice; validate: 2, 2, 2, 1; predict: 2, 2, 2, 1.
    IIG's scope is the group (ranks 0-1, 2-3), GGG's all ranks."""
    for system in ("IIG-sharded", "GGG-sharded"):
        for r in range(WORLD):
            res = runs(system, r)
            fit = 2 * (2 + 1) if system.startswith("GGG") or r < 2 else 2 * (1 + 1)
            assert res["fit"]["rounds"] == fit, (system, r)
            assert res["validate_mem"]["rounds"] == fit + 3, (system, r)
            assert res["predict_mem"]["rounds"] == fit + 6, (system, r)
    for r in range(WORLD):  # gathered in full: no collective per batch
        assert runs("GGG-full", r)["predict_mem"]["rounds"] == 0


@pytest.mark.timeout(200)
def test_full_gather_holds_the_whole_model(runs):
    for r in range(WORLD):
        res = runs("IIG-full", r)
        assert res["predict_mem"]["peak"] == res["predict_mem"]["full"]
        assert res["fit"]["alive_after"] == res["fit"]["full"]  # handed back with full parameters


def test_gather_option():
    assert PaROStrategy(sharding="IIG", gather="sharded").gather == GatherConfig("sharded", "sharded")
    assert PaROStrategy(sharding="IIG").gather == GatherConfig()
    with pytest.raises(ValueError, match="gather must be"):
        PaROStrategy(sharding="IIG", gather="half")
    with pytest.raises(ValueError, match="after_fit"):
        GatherConfig(after_fit="never")
    with pytest.raises(ValueError, match="memory_fraction"):
        GatherConfig(memory_fraction=0)


def test_auto_gathers_in_full_only_when_it_fits(monkeypatch):
    from types import SimpleNamespace

    import lightning_paro.strategy.strategy as strategy_module

    s = PaROStrategy(sharding="IIG", parallel_devices=[torch.device("cpu")])
    s.engine = SimpleNamespace(root=SimpleNamespace(sharded_params=True), full_param_bytes=1000)
    monkeypatch.setattr(strategy_module, "device_memory_bytes", lambda device, ranks_on_host: 3000)
    assert s._gather_in_full("auto") and s._gather_in_full("full") and not s._gather_in_full("sharded")
    monkeypatch.setattr(strategy_module, "device_memory_bytes", lambda device, ranks_on_host: 1500)
    assert not s._gather_in_full("auto")  # 1000 bytes over half of 1500
    monkeypatch.setattr(strategy_module, "device_memory_bytes", _unreadable)
    assert s._gather_in_full("auto")  # memory unknown: in full, as before the option existed
    s.engine.root.sharded_params = False  # P = N: nothing to gather, both modes are the same
    assert s._gather_in_full("sharded")


def _unreadable(device, ranks_on_host):
    raise ValueError("Cannot read the memory of a 'xla' device")


def test_sharded_forward_in_one_process(world_of_one):
    """In one process: a sharded evaluation step gives the full-gather output, holds at most the root unit and two
    blocks, and a step in a round where a peer has finished gathers the units in the order it uses them."""
    from tiny_lm import TinyLM

    from lightning_paro.strategy.engine import PaROEngine
    from lightning_paro.strategy.levels import ShardingSpec

    torch.manual_seed(0)
    model = TinyLM()
    engine = PaROEngine(model, ShardingSpec.parse("GGG"), world_of_one)
    idx = torch.randint(0, 37, (2, 8))
    with torch.no_grad():
        engine.materialize()
        want = model(idx)
        engine.release()
        engine.gather_meter.reset_peak()
        engine.begin_eval()
        engine.eval_step_begin()
        got = model(idx)
        engine.eval_step_end(last=False)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        root = sum(f.full_bytes for f in engine.root.flats)
        block = max(sum(f.full_bytes for f in u.flats) for u in engine.units[:-1])
        assert engine.gather_meter.peak == root + 2 * block < engine.full_param_bytes
        engine.eval_step_begin()
        engine.evaluation.tail = True  # as in a round where a peer has run its last batch
        # a step that uses the units in an order no step used before: announced and gathered as it goes
        x = torch.randn(2, 8, 10)
        got = model.blocks[1](model.blocks[0](x))
        engine.eval_step_end(last=False)
        engine.release()
        engine.materialize()
        torch.testing.assert_close(got, model.blocks[1](model.blocks[0](x)), atol=0, rtol=0)
    engine.wait()


@pytest.mark.timeout(120)
def test_reading_a_module_left_sharded_is_refused_not_a_crash(tmp_path):
    """After a fit that leaves the module sharded, ``model.state_dict()`` raises an error naming the way out, and each
    parameter holds this rank's piece of it (readable, printable, savable: never freed memory); the next stage, the
    export and the checkpoint work, and once a stage hands the module back in full it reads as usual."""
    import lightning as L
    from tiny_lm import TinyLM, loader

    from lightning_paro import GatherConfig, PaROStrategy

    def trainer(after_fit):
        strategy = PaROStrategy(sharding="GGG", group_size=1, gather=GatherConfig(evaluation="sharded",
                                                                                  after_fit=after_fit))
        return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=1)

    torch.manual_seed(0)
    model = TinyLM()
    try:
        t = trainer("sharded")
        t.fit(model, loader(8))
        with pytest.raises(RuntimeError, match="left sharded.*export_full_state_dict"):
            model.state_dict()
        assert set(model.state_dict(keep_vars=True)) == set(t.strategy.engine.module.state_dict(keep_vars=True))
        t.validate(model, loader(4), verbose=False)  # the next stage runs on the sharded module
        t.strategy.export_full_state_dict(tmp_path / "full.pt")
        exported = torch.load(tmp_path / "full.pt", weights_only=True)
        with pytest.raises(RuntimeError, match="left sharded"):
            model.state_dict()
        # every parameter holds readable memory: this rank's piece of it (in a world of one, all of it, flattened),
        # which can be read, printed and saved
        sharded = {s.name for u in t.strategy.engine.units[:-1] for f in u.flats for s in f.slots}
        assert sharded
        for name, p in model.named_parameters():
            assert p.untyped_storage().size() >= p.numel() * p.element_size() > 0, name
            if name in sharded:
                assert p.dim() == 1
                torch.testing.assert_close(p.detach(), exported[name].reshape(-1), rtol=0, atol=0, msg=name)
            assert torch.isfinite(p.sum()) and "Parameter containing" in repr(p)
        torch.save(dict(model.named_parameters()), tmp_path / "pieces.pt")
        assert torch.load(tmp_path / "pieces.pt", weights_only=True).keys() == dict(model.named_parameters()).keys()
        t.save_checkpoint(tmp_path / "between.ckpt")  # saving between stages leaves the pieces in place
        assert all(p.dim() == 1 for n, p in model.named_parameters() if n in sharded)
        t2 = trainer("full")
        t2.validate(model, loader(4), verbose=False)  # hands the module back in full
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, exported[k], rtol=0, atol=0, msg=k)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_tail_round_follows_the_order_peers_run(tmp_path):
    """A model whose forward runs its blocks in reverse registration order, evaluated sharded with no training forward
    before (so no order is known), on 2 ranks with 2 steps and none: in the tail rounds the running rank's gathers are
    announced in the order it uses them, and the finished rank serves them, so the outputs equal the whole model's."""
    launch("eval_order.py", 2, str(tmp_path), timeout=100)
    for rank, steps in ((0, 2), (1, 0)):
        res = json.loads((tmp_path / f"{rank}.json").read_text())
        assert "error" not in res, f"rank {rank}: {res['error']}"
        assert res["steps"] == steps and res["max_diff"] == 0.0
        assert res["rounds"] == 3  # two steps of the slowest rank, and the one that counts no rank running


@pytest.mark.timeout(120)
def test_a_stage_whose_last_batch_cannot_be_known_fails_at_its_start():
    """A ``validation_step`` over ``dataloader_iter`` cannot tell a rank its last batch, so a finished rank would join
    its peers only after the epoch-end hooks and metric sync (a world collective the peers never reach while they
    gather): refused at the stage's start under sharded evaluation, naming the fix; gathered in full it runs."""
    import lightning as L
    from tiny_lm import TinyLM, loader

    from lightning_paro import GatherConfig, PaROStrategy

    class IterStep(TinyLM):
        def validation_step(self, dataloader_iter):
            batch, _, _ = next(dataloader_iter)
            self.log("val_loss", self.loss(batch))

    def trainer(evaluation):
        strategy = PaROStrategy(sharding="GGG", group_size=1, gather=GatherConfig(evaluation=evaluation))
        return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)

    torch.manual_seed(0)
    model = IterStep()
    try:
        with pytest.raises(RuntimeError, match="takes `dataloader_iter`.*evaluation='full'"):
            trainer("sharded").validate(model, loader(4), verbose=False)
        assert trainer("full").validate(model, loader(4), verbose=False)[0]["val_loss"] > 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
