"""Bad input fails early with an error that names the problem and the fix."""


import pytest
import torch
import torch.distributed as dist
from launch import free_port
from torch import nn

import lightning as L
from lightning_paro import VALID_STRATEGIES, PaROStrategy
from lightning_paro.comm.collectives import Communicator
from lightning_paro.comm.topology import Topology
from lightning_paro.strategy.engine import PaROEngine
from lightning_paro.strategy.levels import ShardingSpec


def test_invalid_strategy_string():
    with pytest.raises(ValueError, match="Valid strategies: " + ", ".join(VALID_STRATEGIES)):
        PaROStrategy(sharding="NGN")


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_invalid_group_size_value(bad):
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        PaROStrategy(group_size=bad)


def test_group_size_not_dividing_world_fails_before_launch():
    with pytest.raises(ValueError, match=r"group_size=3 does not divide the world size 4.*\(1, 2, 4\)"):
        L.Trainer(accelerator="cpu", devices=4, strategy=PaROStrategy(group_size=3), logger=False)


def test_16_mixed_is_refused_with_the_alternative():
    # On CPU Lightning turns 16-mixed into bf16-mixed; a scaler-based plugin is what the strategy refuses.
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_paro.strategy.precision import to_paro_precision

    with pytest.raises(ValueError, match="Use precision='bf16-mixed'"):
        to_paro_precision(MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cpu")))


@pytest.fixture
def world_of_one(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    comm = Communicator(Topology.from_process_group())
    yield comm
    comm.close()
    dist.destroy_process_group()


def _engine(comm, model, opts=()):
    return PaROEngine(model, ShardingSpec.parse("IIG"), comm, optimizers=list(opts))


def test_meta_parameters_are_materialised_as_the_cpu_build(world_of_one):
    """Meta parameters are no longer refused: the engine gives them the values a CPU build with the same seed has
    (tests/strategy/test_deferred_init.py holds the rule and its errors)."""
    torch.manual_seed(0)
    cpu = nn.Linear(3, 3)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Linear(3, 3)
    engine = _engine(world_of_one, model)
    engine.materialize()
    for name, p in model.named_parameters():
        assert not p.is_meta
        torch.testing.assert_close(p.detach(), dict(cpu.named_parameters())[name].detach(), rtol=0, atol=0)
    engine.wait()


def test_sparse_embedding_is_refused(world_of_one):
    with pytest.raises(ValueError, match="sparse=True.*Use sparse=False"):
        _engine(world_of_one, nn.Sequential(nn.Embedding(4, 2, sparse=True)))


def test_optimizer_over_foreign_tensor_is_refused(world_of_one):
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the LightningModule"):
        _engine(world_of_one, model, [opt])


def test_optimizer_with_state_is_refused(world_of_one):
    model = nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="already has state before sharding"):
        _engine(world_of_one, model, [opt])


def test_plain_pytorch_loop_with_the_engine(world_of_one):
    """The engine works without Lightning: pre_step / backward / finish_backward / step / after_optimizer_step."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = PaROEngine(model, ShardingSpec.parse("GGG"), world_of_one, optimizers=[opt], units=[nn.Linear])
    x = torch.randn(8, 4)
    for _ in range(3):
        engine.pre_step()
        model(x).pow(2).mean().backward()
        engine.finish_backward(sync=True)
        opt.step()
        engine.after_optimizer_step(opt)
        opt_ref.zero_grad()
        ref(x).pow(2).mean().backward()
        opt_ref.step()
    engine.restore_module()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
