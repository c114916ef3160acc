"""Where collective tensors live, which thread issues collectives, and single-thread mode, on 4 CPU processes.

One launch (``workers/placement.py``) fits five strategies that between them run every kind of collective the engine
issues (HO-Ring global all-reduce, reduce-scatter and all-gather, the three rail collectives, flat intra-group ones,
the control all-reduces of "parameter used" flags and of the clipping norm, set-up broadcasts, Lightning's barrier,
broadcast and reduce), each with HO-Ring on its phase threads and in single-thread mode, under the audit of
``tests/collective_audit.py``. See that module for what the device check catches on a machine without a GPU (a
tensor the package creates without naming a device) and what it cannot (a wrong device named explicitly, CUDA
streams). Removing ``device=`` from the "used" flags' allocation makes this launch fail.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from collective_audit import Recorder
from launch import launch


WORLD = 4
STRATEGIES = ["NNN", "NNI", "IGG", "GIG", "III"]
# Lightning broadcasts its SIGTERM flag from the training thread before every batch, past any strategy hook.
LIGHTNING_SIGTERM = ("broadcast", "MainThread", ["cpu"])


@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("placement")
    launch("placement.py", WORLD, str(out), ",".join(STRATEGIES), timeout=300)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)]


def _calls(audit, mode: str):
    for r in range(WORLD):
        for spec, run in audit[r]["runs"].items():
            for name, thread, devices, count in run["calls"][mode]:
                yield r, spec, name, thread, devices, count


@pytest.mark.timeout(360)
@pytest.mark.parametrize("mode", ["threads", "single"])
def test_every_collective_tensor_is_on_the_compute_device(audit, mode):
    calls = list(_calls(audit, mode))
    names = {c[2] for c in calls}
    # The recorder saw the package's collectives (it is not vacuous): flat, point-to-point (batched in single-thread
    # mode), control all-reduces, broadcasts, and Lightning's object broadcast.
    p2p = {"batch_isend_irecv"} if mode == "single" else {"isend", "irecv"}
    assert {"all_reduce", "broadcast", "broadcast_object_list", "all_gather_single",
            "reduce_scatter_single"} | p2p <= names, names
    misplaced = [c for c in calls if any(d != "cpu" for d in c[4])]
    assert not misplaced, misplaced[:10]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("mode", ["threads", "single"])
def test_the_package_issues_no_collective_from_the_training_thread(audit, mode):
    allowed = {"paro-comm"} if mode == "single" else {"paro-comm", "ho-ring-intra-scatter", "ho-ring-inter-scatter",
                                                       "ho-ring-inter-gather", "ho-ring-intra-gather"}
    others = {(name, thread, tuple(devices)) for _, _, name, thread, devices, _ in _calls(audit, mode)
              if thread not in allowed}
    assert others == {tuple(LIGHTNING_SIGTERM[:2]) + (tuple(LIGHTNING_SIGTERM[2]),)}, others


@pytest.mark.timeout(360)
def test_single_thread_mode_leaves_no_room_for_another_threads_collective(audit):
    """In single-thread mode a submit returns once its collective is issued, so Lightning's SIGTERM broadcast never
    comes while the communication thread is busy. (On phase threads it does: that is what NCCL would not survive.)"""
    for r in range(WORLD):
        for spec, run in audit[r]["runs"].items():
            assert run["beside"]["single"] == [], (r, spec, run["beside"]["single"])
            assert all(c[:3] == list(LIGHTNING_SIGTERM) for c in run["beside"]["threads"]), run["beside"]["threads"]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("spec", STRATEGIES)
def test_single_thread_mode_gives_the_same_bits(audit, spec):
    for r in range(WORLD):
        run = audit[r]["runs"][spec]
        assert run["same_losses"] and run["same_weights"], (r, spec)
        assert len(run["losses"]) == 3 and run["losses"][-1] < run["losses"][0]


# ------------------------------------------------------------------------------------------- the audit itself

def test_the_audit_sees_a_tensor_created_without_a_device(world_of_one):
    """What the fit-level audit relies on: under it, a tensor made without a device is a meta tensor, which the
    recorder reports, and which the communicator's control path refuses."""
    recorder = Recorder(torch.device("cpu"))
    all_reduce = recorder._wrap("all_reduce", dist.all_reduce)  # not installed: the session keeps torch's own
    with torch.device("meta"):
        flags = torch.zeros(3, dtype=torch.int32)  # as the "used" flags were allocated before
        placed = torch.zeros(3, dtype=torch.int32, device=torch.device("cpu"))
    all_reduce(placed)
    all_reduce(flags)  # a no-op in a world of one; what matters is the record
    assert recorder.misplaced() == [("all_reduce", "MainThread", ("meta",))]
    with pytest.raises(ValueError, match="tensor is on meta, the communicator's groups carry cpu"):
        world_of_one.scalar_all_reduce(flags, "global")
