"""Checkpoints: exact resume for every strategy, resharding across world size, group size and strategy, full files
that Lightning's "ddp" reads and writes, atomic publishing, and clear errors for damaged or mismatched ones."""

import json
import math
import random

import pytest
import torch
from launch import launch

from lightning_paro.strategy.checkpoint import convert_to_full
from lightning_paro.strategy.flat_chunks import range_chunks
from lightning_paro.strategy.levels import VALID_STRATEGIES


@pytest.mark.parametrize("seed", range(30))
def test_range_chunks_tile_the_range_with_contiguous_rectangles(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
    n = math.prod(shape)
    start = rng.randint(0, n)
    stop = rng.randint(start, n)
    mark = torch.zeros(n, dtype=torch.int64)
    for off, size, flat_start in range_chunks(shape, start, stop):
        block = torch.zeros(shape, dtype=torch.int64)
        block[tuple(slice(o, o + s) for o, s in zip(off, size))] = 1
        flat = block.reshape(-1)
        assert flat[flat_start:flat_start + math.prod(size)].sum() == math.prod(size)  # contiguous
        mark += flat
    expected = torch.zeros(n, dtype=torch.int64)
    expected[start:stop] = 1
    assert torch.equal(mark, expected)
    assert len(range_chunks(shape, start, stop)) <= max(1, 2 * len(shape) - 1)


def _run(tmp, world, jobs, timeout=420):
    """Run ``jobs`` in order (a resume job follows the job that saved its checkpoint) in one set of worker processes:
    every job builds its own Trainer and strategy, which reuse the process groups of the ones before."""
    batch = tmp / "jobs.json"
    batch.write_text(json.dumps(jobs))
    launch("ckpt_jobs.py", world, str(tmp), str(batch), timeout=timeout)

    def result(job_id, rank=0):
        return json.loads((tmp / f"{job_id}.{rank}.json").read_text())

    def weights(job_id):
        return torch.load(tmp / f"{job_id}.pt", weights_only=True)

    return result, weights


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    jobs = []
    for s in VALID_STRATEGIES:
        jobs += [{"id": f"{s}-straight", "strategy": s, "epochs": 2},
                 {"id": f"{s}-first", "strategy": s, "epochs": 1, "save": str(tmp / f"{s}.ckpt")},
                 {"id": f"{s}-resumed", "strategy": s, "epochs": 2, "resume": str(tmp / f"{s}.ckpt"), "seed": 7}]
    return _run(tmp, 4, jobs, timeout=600)


def test_strategies_built_one_after_another_reuse_their_process_groups(resume_runs):
    """42 Trainers in one process: the threads alive after the last job are no more than after the first one (every
    strategy reuses the process groups and HO-Ring phase threads of the same layout instead of adding its own)."""
    result, _ = resume_runs
    first, last = f"{VALID_STRATEGIES[0]}-straight", f"{VALID_STRATEGIES[-1]}-resumed"
    for r in range(4):
        assert result(last, r)["threads"] <= result(first, r)["threads"], (result(first, r), result(last, r))


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", VALID_STRATEGIES)
def test_exact_resume_is_bitwise(resume_runs, name):
    """Fit 3 steps, save (sharded), resume in fresh processes' state to 6: the same losses and weights, bit for bit,
    as fitting 6 straight (optimizer state, LR schedule, loop counters and data position all restored)."""
    result, weights = resume_runs
    for r in range(4):
        straight = result(f"{name}-straight", r)["losses"]
        first = result(f"{name}-first", r)["losses"]
        resumed = result(f"{name}-resumed", r)
        assert first == straight[:6]
        assert resumed["losses"] == straight[6:]
        assert resumed["global_step"] == 6
    a, b = weights(f"{name}-straight"), weights(f"{name}-resumed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    c = lambda name: str(tmp / name)  # noqa: E731
    four = [
        {"id": "iig-save", "strategy": "IIG", "epochs": 1, "save": c("iig")},
        {"id": "ggg-save", "strategy": "GGG", "epochs": 1, "save": c("ggg")},
        {"id": "ddp-save", "strategy": "ddp", "epochs": 1, "save": c("ddp.ckpt")},
        {"id": "full-save", "strategy": "IIG", "state_dict_type": "full", "epochs": 1, "save": c("iig-full.ckpt")},
        {"convert": [c("iig"), c("iig-converted.ckpt")]},
        {"convert": [c("ggg"), c("ggg-converted.ckpt")]},
        # GGG on 4 -> NNN on 4, against "ddp" resumed from the consolidated file
        {"id": "ggg-to-nnn", "strategy": "NNN", "epochs": 2, "resume": c("ggg"), "seed": 3},
        {"id": "ggg-to-ddp", "strategy": "ddp", "epochs": 2, "resume": c("ggg-converted.ckpt"), "seed": 4},
        # IIG with groups of 2 -> IIG with groups of 1 (4 groups), same world
        {"id": "iig-to-m1", "strategy": "IIG", "group_size": 1, "epochs": 2, "resume": c("iig"), "seed": 5},
        {"id": "iig-to-ddp4", "strategy": "ddp", "epochs": 2, "resume": c("iig-converted.ckpt"), "seed": 6},
        # a full "ddp" checkpoint into PaRO, and a full PaRO checkpoint into "ddp"
        {"id": "ddp-to-paro", "strategy": "IGG", "epochs": 2, "resume": c("ddp.ckpt"), "seed": 8},
        {"id": "ddp-to-ddp", "strategy": "ddp", "epochs": 2, "resume": c("ddp.ckpt"), "seed": 9},
        {"id": "full-to-ddp", "strategy": "ddp", "epochs": 2, "resume": c("iig-full.ckpt"), "seed": 10},
        {"id": "full-to-paro", "strategy": "IIG", "epochs": 2, "resume": c("iig-full.ckpt"), "seed": 11},
        # damaged or mismatched checkpoints fail fast, on every rank, naming the problem
        {"id": "mismatch", "strategy": "IIG", "epochs": 2, "resume": c("iig"), "model": {"freeze_block": None,
         "unused": False}, "expect_error": True},
        {"id": "model-checkpoint", "strategy": "NIG", "epochs": 2, "model_checkpoint": c("mc")},
        {"damage": [c("ggg"), c("ggg-truncated")]},
        {"id": "truncated", "strategy": "GGG", "epochs": 2, "resume": c("ggg-truncated"), "expect_error": True},
    ]
    result4, weights4 = _run(tmp, 4, four, timeout=600)
    two = [
        {"id": "iig4-to-nig2", "strategy": "NIG", "epochs": 2, "resume": c("iig"), "seed": 12},
        {"id": "iig4-to-ddp2", "strategy": "ddp", "epochs": 2, "resume": c("iig-converted.ckpt"), "seed": 13},
    ]
    result2, weights2 = _run(tmp, 2, two, timeout=300)
    return tmp, (result4, weights4), (result2, weights2)


def _same_run(res, a, b, world):
    result, weights = res
    for r in range(world):
        la, lb = result(a, r)["losses"], result(b, r)["losses"]
        assert len(la) == len(lb) > 0
        assert la == pytest.approx(lb, abs=1e-5)
    wa, wb = weights(a), weights(b)
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=0, msg=k)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("paro,ddp,world", [
    ("ggg-to-nnn", "ggg-to-ddp", 4), ("iig-to-m1", "iig-to-ddp4", 4), ("ddp-to-paro", "ddp-to-ddp", 4),
    ("full-to-paro", "full-to-ddp", 4), ("iig4-to-nig2", "iig4-to-ddp2", 2)])
def test_resharded_resume_matches_ddp_from_the_same_state(reshard_runs, paro, ddp, world):
    """A checkpoint continues under another strategy, group size or world size exactly as "ddp" continues from the
    same weights and optimizer states (the consolidated file)."""
    _, four, two = reshard_runs
    _same_run(four if world == 4 else two, paro, ddp, world)
    losses = (four if world == 4 else two)[0](paro)["losses"]
    assert len(losses) == 6 if world == 4 else 12  # resumed at step 3 of 6 (world 2: an epoch has 6 steps)


@pytest.mark.timeout(900)
def test_full_checkpoint_loads_without_distributed_set_up(reshard_runs):
    from tiny_lm import TinyLM

    tmp, _, _ = reshard_runs
    for name in ("iig-full.ckpt", "iig-converted.ckpt"):
        model = TinyLM.load_from_checkpoint(tmp / name, weights_only=True)
        assert model.blocks[0].fc1.weight.shape == (18, 10)
    full = torch.load(tmp / "iig-full.ckpt", weights_only=True)
    conv = torch.load(tmp / "iig-converted.ckpt", weights_only=True)
    # both formats agree with each other: the same trained weights (from the same run configuration and seed)
    for k, v in full["state_dict"].items():
        torch.testing.assert_close(conv["state_dict"][k], v, atol=0, rtol=0)
    assert full["optimizer_states"][0]["param_groups"][0]["params"] == \
        conv["optimizer_states"][0]["param_groups"][0]["params"]


@pytest.mark.timeout(900)
def test_mismatched_checkpoint_fails_naming_the_keys(reshard_runs):
    _, (result, _), _ = reshard_runs
    for r in range(4):
        err = result("mismatch", r)["error"]
        assert "unexpected keys:" in err and "unused.weight" in err and "unused.bias" in err


@pytest.mark.timeout(900)
def test_model_checkpoint_writes_sharded_and_removes_the_old_one(reshard_runs):
    tmp, _, _ = reshard_runs
    entries = sorted(p.name for p in (tmp / "mc").iterdir())
    assert entries == ["epoch=1-step=6.ckpt"]  # epoch 0's checkpoint was removed (save_top_k=1)
    assert (tmp / "mc" / entries[0] / "meta.pt").is_file()


@pytest.mark.timeout(900)
def test_truncated_checkpoint_fails_on_every_rank_without_hanging(reshard_runs):
    _, (result, _), _ = reshard_runs
    errors = [result("truncated", r)["error"] for r in range(4)]
    assert all(errors), errors
    assert all("Could not read the sharded checkpoint" in e and "damaged or truncated" in e for e in errors), errors


@pytest.mark.timeout(900)
def test_sharded_checkpoint_layout_and_single_writer(reshard_runs):
    tmp, _, _ = reshard_runs
    ckpt = tmp / "iig"
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "meta.pt"]
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    fc1 = md.state_dict_metadata["state_dict.blocks.0.fc1.weight"]
    assert tuple(fc1.size) == (18, 10)
    # every element is stored exactly once: the chunks of each tensor tile it without overlap
    for key, item in md.state_dict_metadata.items():
        if hasattr(item, "chunks") and len(item.size) > 0:
            assert sum(math.prod(ch.sizes) for ch in item.chunks) == math.prod(item.size), key
    assert not list(tmp.glob(".*partial*"))  # nothing left aside


def test_convert_refuses_incomplete_directories(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match="not a complete sharded checkpoint"):
        convert_to_full(tmp_path / "ck", tmp_path / "out.ckpt")
    with pytest.raises(FileNotFoundError, match="No checkpoint directory"):
        convert_to_full(tmp_path / "nope", tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.timeout(300)
def test_kill_9_during_saves_never_leaves_a_checkpoint_that_looks_complete(tmp_path):
    """Kill every process at random moments while checkpoints are being written (new ones and overwrites, sharded
    directories and full files in turn): every visible checkpoint is complete and consolidates, and the earlier ones
    are intact."""
    import subprocess
    import time

    from launch import kill_all, start

    from lightning_paro.strategy.checkpoint import is_sharded_checkpoint

    rng = random.Random("kill-9")
    for trial in range(4):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        procs = start("ckpt_kill.py", 2, str(d), output=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not (d / "ready").exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "saver did not start"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.05, 1.5))
        finally:
            kill_all(procs)
        visible = [p for p in d.iterdir() if not p.name.startswith(".") and p.name != "ready"]
        assert {"good", "good.ckpt"} <= {p.name for p in visible}
        for p in visible:
            if p.suffix != ".ckpt":
                assert is_sharded_checkpoint(p), p
                convert_to_full(p, tmp_path / f"check-{trial}-{p.name}.ckpt")  # reads every stored byte
            else:
                ckpt = torch.load(p, weights_only=True)
                assert "state_dict" in ckpt and "optimizer_states" in ckpt, p
