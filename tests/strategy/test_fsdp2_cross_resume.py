"""Cross-resume between PaRO and FSDP2 (Lightning's ``ModelParallelStrategy`` with a model that applies
``fully_shard`` to its blocks and itself in ``configure_model``), each against ``"ddp"``.

One launch of 4 processes: ``"ddp"`` for 4 optimizer steps (the reference); PaRO IIG (groups of 2) for 2 steps and
``trainer.save_checkpoint``, resumed under ``ModelParallelStrategy`` for 2 more; ``ModelParallelStrategy`` for 2 steps
and its own sharded checkpoint, resumed under PaRO GGG for 2 more. Then one launch of 2 processes resumes both
checkpoints again at that world size. Each resumed run's losses equal ``"ddp"``'s last 2 within 1e-5: per rank at
the same world size, as the mean over ranks (the global batch's loss) at the other. The phases and their files are
described in ``workers/fsdp2_cross.py``.
"""

import json
import subprocess

import pytest
from launch import launch

TOL, K, M = 1e-5, 2, 2  # K steps before the checkpoint, M after
SAVE_WORLD = 4
LAUNCHES = {
    4: ["ddp", "paro_iig", "mp_from_paro", "fsdp2", "paro_ggg_from_fsdp2", "fsdp2_unused",
        "paro_ggg_from_fsdp2_unused"],
    2: ["mp_from_paro", "paro_ggg_from_fsdp2"],
}


class Runs:
    """The phases' results, read back with an error that names the phase, the world size and the rank."""

    def __init__(self, out, launch_errors):
        self.out, self.launch_errors = out, launch_errors

    def __call__(self, phase: str, world: int, rank: int) -> dict:
        where = f"phase {phase!r} (world {world}, rank {rank})"
        path = self.out / f"{phase}.w{world}.{rank}.json"
        launch_error = self.launch_errors.get(world, "")
        if not path.exists():
            pytest.fail(f"{where} never started.{launch_error}")
        res = json.loads(path.read_text())
        if res.get("started"):
            pytest.fail(f"{where} did not finish: it hung or its process died.{launch_error}")
        if "skipped" in res:
            pytest.fail(f"{where} did not run: {res['skipped']}")
        if "error" in res:
            pytest.fail(f"{where} failed: {res['error']}")
        return res

    def global_losses(self, phase: str, world: int) -> list[float]:
        """The loss of each step's global batch: the mean of the ranks' losses (equal-sized local batches)."""
        per_rank = [self(phase, world, r)["losses"] for r in range(world)]
        return [sum(step) / world for step in zip(*per_rank, strict=True)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_cross")
    launch_errors = {}
    for world, phases in LAUNCHES.items():
        try:
            launch("fsdp2_cross.py", world, str(out), ",".join(phases), timeout=240 if world == 4 else 150)
        except (RuntimeError, subprocess.TimeoutExpired) as err:  # named per phase by Runs; the cause kept here
            launch_errors[world] = f"\nThe launch of {world} processes failed: {str(err)[-3000:]}"
    return Runs(out, launch_errors)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("phase", ["paro_iig", "fsdp2", "fsdp2_unused"])
def test_the_runs_that_save_train_like_ddp(runs, phase):
    """Before their checkpoints, PaRO and FSDP2 give ``"ddp"``'s losses; only ``ModelParallelStrategy`` shards the
    model into DTensors (``configure_model`` does nothing under PaRO)."""
    for r in range(SAVE_WORLD):
        got, want = runs(phase, SAVE_WORLD, r), runs("ddp", SAVE_WORLD, r)
        assert len(want["losses"]) == K + M
        assert got["losses"] == pytest.approx(want["losses"][:K], abs=TOL), f"{phase}, rank {r}"
        assert got["global_step"] == got["optimizer_steps"] == K, f"{phase}, rank {r}"
        if phase.startswith("fsdp2"):
            assert got["dtensor_params"] == got["params"] > 0, f"{phase}, rank {r}"
        else:
            assert got["dtensor_params"] == 0, f"{phase}, rank {r}"


def check_resumed(runs, phase: str, world: int, fsdp2: bool) -> None:
    for r in range(world):
        res = runs(phase, world, r)
        # the loops and the optimizer's step counts come from the checkpoint: a fresh optimizer would count M
        assert res["global_step"] == res["optimizer_steps"] == K + M, f"{phase}, world {world}, rank {r}: {res}"
        assert res["dtensor_params"] == (res["params"] if fsdp2 else 0), f"{phase}, world {world}, rank {r}"
        if world == SAVE_WORLD:
            want = runs("ddp", SAVE_WORLD, r)["losses"][K:]
            assert res["losses"] == pytest.approx(want, abs=TOL), f"{phase}, world {world}, rank {r}"
    if world != SAVE_WORLD:
        want = runs.global_losses("ddp", SAVE_WORLD)[K:]
        assert runs.global_losses(phase, world) == pytest.approx(want, abs=TOL), f"{phase}, world {world}"


@pytest.mark.timeout(480)
@pytest.mark.parametrize("world", [4, 2])
def test_a_paro_checkpoint_resumes_under_model_parallel_strategy(runs, world):
    """PaRO IIG's sharded checkpoint (4 ranks, groups of 2; TinyLM with tied weights, a frozen block and a parameter
    no step uses) resumed by ``ModelParallelStrategy`` with FSDP2 continues like ``"ddp"``."""
    check_resumed(runs, "mp_from_paro", world, fsdp2=True)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("world", [4, 2])
def test_an_fsdp2_checkpoint_resumes_under_paro(runs, world):
    """``ModelParallelStrategy``'s own sharded checkpoint (4 ranks, FSDP2) resumed by PaRO GGG continues like
    ``"ddp"``. The model has tied weights and a frozen block, but no parameter that no step uses (next test)."""
    check_resumed(runs, "paro_ggg_from_fsdp2", world, fsdp2=False)


@pytest.mark.timeout(480)
def test_an_fsdp2_checkpoint_with_a_parameter_no_step_used_resumes_under_paro(runs):
    """As above with TinyLM's unused parameter, which has no optimizer state in FSDP2's checkpoint (as in torch's
    own optimizers): it starts from zero state, as PaRO's own checkpoint stores it."""
    check_resumed(runs, "paro_ggg_from_fsdp2_unused", SAVE_WORLD, fsdp2=False)
