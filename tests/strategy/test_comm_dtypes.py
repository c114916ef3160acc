"""Communication dtypes on the demo GPT: ``param_dtype="bf16"``, ``reduce_dtype="bf16"`` and
``inter_quant="int8"``, each against the fp32 run.

One launch of 4 processes (2 groups of 2) trains the demo GPT (tiny shape: 2 blocks of width 32, 32-byte windows,
about 42k parameters) for 200 optimizer steps under IIG, the demo's strategy, three times: with exact communication,
with both dtypes bf16, and with the syncs between groups int8-quantized, from the same initial weights on the same
batches.

The tolerance on the final loss is the resolution of the measure itself, fixed before any run: the final loss is the
mean training loss of the last 50 steps, whose per-step losses scatter with standard deviation s (different batches),
so it is known to within a standard error of s / sqrt(50); each option's run must land within two of those of the
fp32 run. docs/config.md states the rule and the measured figures.
"""

import json
import math
import statistics

import pytest
import torch
from launch import launch
from traffic import bytes_by_scope

from lightning_paro.strategy.levels import ShardingSpec
from lightning_paro.strategy.transitions import CommDtypes
from lightning_paro.strategy.volumes import step_traffic

WORLD, M, STEPS, LAST = 4, 2, 200, 50
EXACT_RUN, BF16_RUN, INT8_RUN, INT8_EF_RUN = "IIG~-+-", "IIG~bf16+bf16", "IIG~-+-+int8", "IIG~-+-+int8ef"
# 8 steps with a validation and a sharded checkpoint after step 4: P = N and P = I, each with a separate master
CHECKED = ["NNG~bf16+bf16:8:check", "IIG~bf16+bf16:8:check"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_dtypes")
    launch("comm_dtypes.py", WORLD, str(out), str(STEPS), EXACT_RUN, BF16_RUN, INT8_RUN, INT8_EF_RUN, *CHECKED,
           timeout=240)

    def load(run):
        return ([json.loads((out / f"{run}.{r}.json").read_text()) for r in range(WORLD)],
                [torch.load(out / f"{run}.{r}.pt", weights_only=True) for r in range(WORLD)])

    return load


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", [BF16_RUN, INT8_RUN, INT8_EF_RUN])
def test_final_loss_within_the_resolution_of_the_fp32_run(runs, run):
    exact = runs(EXACT_RUN)[0][0]["losses"]
    got = runs(run)[0][0]["losses"]
    assert len(exact) == len(got) == STEPS
    final_exact, final = statistics.mean(exact[-LAST:]), statistics.mean(got[-LAST:])
    tolerance = 2 * statistics.stdev(exact[-LAST:]) / math.sqrt(LAST)
    assert abs(final - final_exact) <= tolerance, (final, final_exact, tolerance)
    assert final_exact < 0.5 * exact[0]  # it trained
    assert got != exact  # the rounding is real


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", [INT8_RUN, INT8_EF_RUN])
def test_int8_between_groups_sends_a_quarter_there_and_the_same_inside(runs, run):
    (exact, _), (int8, weights) = runs(EXACT_RUN), runs(run)
    for r in range(WORLD):
        # error feedback: the trainable flat groups keep an error buffer (they all cross groups under IIG)
        assert [f["error_feedback"] for f in int8[r]["flats"]] == [
            run == INT8_EF_RUN and f["trainable"] for f in int8[r]["flats"]]
        for a, b in zip(int8[r]["traffic"], exact[r]["traffic"]):
            assert bytes_by_scope(a)["intra"] == bytes_by_scope(b)["intra"]
            assert 0.25 * bytes_by_scope(b)["inter"] < bytes_by_scope(a)["inter"] < 0.26 * bytes_by_scope(b)["inter"]
        for k, v in weights[r].items():
            assert torch.equal(v, weights[0][k]), (r, k)


@pytest.mark.timeout(300)
def test_bf16_halves_every_byte_and_hands_back_exact_identical_weights(runs):
    spec = ShardingSpec.parse("IIG")
    (exact, _), (bf16, weights) = runs(EXACT_RUN), runs(BF16_RUN)
    for r in range(WORLD):
        flats = bf16[r]["flats"]
        want = {"intra": 0.0, "inter": 0.0}
        for f in flats:
            S = f["padded"] * f["elsize"]
            t = step_traffic(spec, S, S if f["trainable"] else 0, m=M, g=WORLD // M, accumulation=1,
                             gathers=1 if f["root"] else 2, comm=CommDtypes(torch.bfloat16, torch.bfloat16),
                             element_bytes=f["elsize"])
            want["intra"] += t.intra
            want["inter"] += t.inter
        for a, b in zip(bf16[r]["traffic"], exact[r]["traffic"]):
            assert bytes_by_scope(a) == want
            assert bytes_by_scope(a) == {k: v / 2 for k, v in bytes_by_scope(b).items()}
        # after fit every rank holds the same weights, and they are the fp32 masters, not bf16-rounded copies
        for k, v in weights[r].items():
            assert torch.equal(v, weights[0][k]), (r, k)
    w = weights[0]["blocks.0.mlp.0.weight"]
    assert not torch.equal(w.to(torch.bfloat16).float(), w)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", CHECKED)
def test_a_checkpoint_in_the_middle_of_training_holds_the_fp32_masters(runs, run):
    """While training computes with the bf16-rounded copy (the parameter storage is rounded, its own slice too), a
    sharded checkpoint holds exactly the optimizer's fp32 master weights on every rank; validation runs."""
    ranks, _ = runs(run)
    for r in range(WORLD):
        assert all(ranks[r]["rounded_before_save"]), r
        assert all(ranks[r]["checkpoint_is_master"]), r
        assert math.isfinite(ranks[r]["val_loss"]) and ranks[r]["val_loss"] == ranks[0]["val_loss"]


def test_the_options_name_the_dtypes_and_refuse_others():
    from lightning_paro import PaROStrategy
    from lightning_paro.strategy.options import OptionError, PaROOptions
    from lightning_paro.strategy.transitions import EXACT

    assert PaROOptions().comm_dtypes == EXACT  # the default: every buffer in its own dtype
    assert PaROOptions(param_dtype="bf16").comm_dtypes == CommDtypes(torch.bfloat16, None)
    assert PaROOptions(param_dtype=torch.bfloat16, reduce_dtype="FP32").comm_dtypes == CommDtypes(
        torch.bfloat16, torch.float32)
    for option in ("param_dtype", "reduce_dtype"):
        for bad in ("fp16", torch.int8, 16):
            with pytest.raises(OptionError, match=f"{option} must be 'bf16', 'fp32'") as info:
                PaROOptions(**{option: bad})
            assert info.value.option == option
    with pytest.raises(ValueError, match="reduce_dtype"):
        PaROStrategy(reduce_dtype="int8")
    assert PaROOptions(inter_quant="int8").comm_dtypes == CommDtypes(inter_quant="int8")
    assert PaROOptions(inter_quant="int8", error_feedback=True).comm_dtypes.error_feedback
    with pytest.raises(OptionError, match="needs inter_quant='int8'"):
        PaROOptions(error_feedback=True)
    with pytest.raises(OptionError, match="inter_quant must be 'int8'") as info:
        PaROOptions(inter_quant="int4")
    assert info.value.option == "inter_quant"
    assert PaROStrategy(sharding="IIG", param_dtype="bf16").options.comm_dtypes.params == torch.bfloat16


def test_the_cost_model_counts_the_bytes_and_the_master_copy():
    """The planner's volumes, times and memory follow the dtypes: bf16 halves every byte of an fp32 model, so a
    strategy bound by the inter-group link predicts a shorter step; P != OS with rounded parameters costs a separate
    fp32 master (P = OS, or bf16 parameters that carry a master already, do not)."""
    import dataclasses

    from lightning_paro.planner.cost_model import memory, predict
    from lightning_paro.planner.inputs import Cluster, Compute, Link, Workload

    fp32 = Workload(num_params=1e9, num_trainable=1e9, accumulation=4, param_bytes=4, grad_bytes=4, optim_bytes=8)
    bf16 = dataclasses.replace(fp32, comm=CommDtypes(torch.bfloat16, torch.bfloat16))
    cluster = Cluster(32, 8, Link.gbit(400), Link.gbit(10), device_memory=80e9)
    compute = Compute(micro_step_seconds=0.1)
    for name in ("NNN", "IIG", "GGG", "NIG"):
        a, b = predict(name, fp32, cluster, compute), predict(name, bf16, cluster, compute)
        assert (b.traffic.intra, b.traffic.inter) == pytest.approx((a.traffic.intra / 2, a.traffic.inter / 2))
        assert b.step_seconds < a.step_seconds
    psi_os = 1e9 / 32
    assert memory(ShardingSpec.parse("IIG"), bf16, cluster).optim == pytest.approx(
        memory(ShardingSpec.parse("IIG"), fp32, cluster).optim + 4 * psi_os)
    for name in ("GGG", "III"):  # P = OS: the master is the parameter shard itself
        assert memory(ShardingSpec.parse(name), bf16, cluster) == memory(ShardingSpec.parse(name), fp32, cluster)
    half = dataclasses.replace(fp32, param_bytes=2, grad_bytes=2, optim_bytes=12)
    half_bf16 = dataclasses.replace(half, comm=bf16.comm)
    assert memory(ShardingSpec.parse("IIG"), half_bf16, cluster) == memory(ShardingSpec.parse("IIG"), half, cluster)
    assert predict("IIG", half_bf16, cluster, compute).traffic == predict("IIG", half, cluster, compute).traffic
    # int8 between groups: what crosses groups shrinks to about a quarter, the traffic inside groups stays; the
    # quantized parameter sync needs the separate master too
    int8 = dataclasses.replace(fp32, comm=CommDtypes(inter_quant="int8"))
    a, q = predict("IIG", fp32, cluster, compute), predict("IIG", int8, cluster, compute)
    assert q.traffic.intra == a.traffic.intra
    assert q.traffic.inter == pytest.approx(a.traffic.inter * (1 + 4 / 256) / 4)
    assert q.step_seconds < a.step_seconds
    assert q.memory.optim == pytest.approx(a.memory.optim + 4 * psi_os)
    ef = dataclasses.replace(fp32, comm=CommDtypes(inter_quant="int8", error_feedback=True))
    assert predict("IIG", ef, cluster, compute).memory.grads == pytest.approx(q.memory.grads + 4 * 1e9 / 8)
    assert predict("IIG", ef, cluster, compute).traffic == q.traffic  # error feedback sends nothing more
    a, q = predict("GGG", fp32, cluster, compute), predict("GGG", int8, cluster, compute)  # global collectives too
    assert q.traffic.intra == a.traffic.intra
    assert q.traffic.inter == pytest.approx(a.traffic.inter * (1 + 4 / 256) / 4)
