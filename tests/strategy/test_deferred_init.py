"""Deferred initialisation (a model built on the meta device gets its values unit by unit, into each rank's shards)
and sharded loading of pretrained weights, on 4 processes under GGG (2 groups of 2)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from launch import launch  # noqa: E402
from meta_models import NoReset  # noqa: E402

from lightning_paro.strategy.engine import PaROEngine  # noqa: E402
from lightning_paro.strategy.levels import ShardingSpec  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One launch for both checks: the engine's values, then the Trainers (which reuse the process group)."""
    out = tmp_path_factory.mktemp("deferred")
    launch("deferred_init.py", 4, "values,trainer", str(out), timeout=600)
    return out


def _results(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}.{r}.json").read_text()) for r in range(4)]


def test_meta_build_equals_cpu_build(runs):
    """A GPT, a model with tied weights and BatchNorm buffers, and a Hugging Face Llama (untied and tied) built on the
    meta device and sharded by the engine hold, on every rank, exactly the values of the same model built on CPU from
    rank 0's seed; every rank holds a quarter of the parameters; ties survive; the process's generator is left as it
    was."""
    for rank, result in enumerate(_results(runs, "values")):
        assert set(result) == {"gpt", "tied", "llama", "llama_tied"}
        for name, r in result.items():
            assert all(r["equal"]) and len(r["equal"]) == len(r["names"]), (rank, name, r["names"])
            assert r["local_over_padded"] == 0.25
            assert r["rng_untouched"] and r["buffers_on_cpu"]
            assert all(same for _a, _b, same in r["ties"]), (name, r["ties"])
        assert [t[:2] for t in result["gpt"]["ties"]] == [["embed.weight", "head.weight"]]
        assert len(result["tied"]["ties"]) == 3 and len(result["llama_tied"]["ties"]) == 1
        assert any("running_mean" in n for n in result["tied"]["names"])


def test_meta_built_model_trains_saves_resumes_and_loads_pretrained(runs):
    """The GPT built in ``configure_model`` on the meta device trains to the same losses as the one built on CPU,
    validates, saves and resumes to the losses of the CPU-built model resumed the same way; filled from a safetensors
    file or a torch file at set-up (``init_from_pretrained``) or after it (``load_pretrained``) it holds the file's
    values, each rank a quarter of them."""
    for r in _results(runs, "trainer"):
        assert len(r["cpu_losses"]) == 4
        assert r["meta_losses"] == r["cpu_losses"][:2]
        # resumed, it continues as the CPU-built model resumed from its own checkpoint does
        assert len(r["resumed_losses"]) == 2 and r["resumed_losses"] == r["resumed_cpu_losses"]
        assert r["resumed_losses"][0] == r["cpu_losses"][2]
        assert r["val_loss"] > 0
        assert r["pretrained_safetensors"] and r["pretrained_pt"] and r["load_pretrained"]
        # the tied head is one tensor; its padding adds at most a few elements per flat group
        assert r["pretrained_safetensors_bytes"] == r["pretrained_pt_bytes"] < 0.26 * r["full_param_bytes"]


def test_module_no_call_initialises_is_named(world_of_one):
    """A meta tensor that no initialisation writes (its module has no reset_parameters) is an error naming it."""
    with torch.device("meta"):
        model = NoReset()
    with pytest.raises(RuntimeError, match=r"'scale' of module '<root>'.*reset_parameters"):
        PaROEngine(model, ShardingSpec.parse("GGG"), world_of_one)


def test_pretrained_file_missing_names_refused_before_setup(tmp_path):
    from safetensors.torch import save_file

    from lightning_paro.strategy.loading import init_from_pretrained

    with torch.device("meta"):
        model = NoReset()
    save_file({"lin.weight": torch.zeros(4, 4)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(KeyError, match=r"no tensor for 2 of the model's names.*scale"):
        init_from_pretrained(model, tmp_path / "w.safetensors")


def test_init_module_empty_init_builds_on_the_meta_device():
    """``trainer.init_module(empty_init=True)`` under PaROStrategy builds on the meta device (set-up materialises);
    without ``empty_init`` it builds with values, as before."""
    import lightning as L
    from meta_models import GPTNet

    from lightning_paro import PaROStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PaROStrategy(sharding="GGG", group_size=1),
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    with trainer.init_module(empty_init=True):
        empty = GPTNet(vocab=10, dim=4, heads=2, layers=2, seq_len=4)
    with trainer.init_module(empty_init=False):
        built = GPTNet(vocab=10, dim=4, heads=2, layers=2, seq_len=4)
    assert all(p.is_meta for p in empty.parameters())
    assert not any(p.is_meta for p in built.parameters())
