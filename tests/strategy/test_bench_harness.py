"""The benchmark harnesses' pure parts: the three-line rule, the registered settings and their scoring, the accuracy
summary (paired differences across seeds), and the command lines of the anchors. Nothing here starts a process."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "train"))
sys.path.insert(0, str(ROOT / "bench" / "auto"))
import accuracy  # noqa: E402
import anchors  # noqa: E402
import prereg  # noqa: E402
import run  # noqa: E402
from choice import SettingResult, three_line_rule  # noqa: E402


def test_the_three_line_rule() -> None:
    tps = {"NNG": 1.0, "IIG": 1.0, "IGG": 1.0, "GGG": 1.0}
    mem = {"NNG": 4, "IIG": 3, "IGG": 2, "GGG": 1}
    assert three_line_rule(SettingResult("a", tps, {"NNG", "IIG", "GGG"}, mem)) == "NNG"
    assert three_line_rule(SettingResult("b", tps, {"IIG", "IGG", "GGG"}, mem)) == "IIG"
    assert three_line_rule(SettingResult("c", tps, {"IGG", "GGG"}, mem)) == "IGG"
    assert three_line_rule(SettingResult("d", tps, {"GGG"}, mem)) == "GGG"


def test_the_registered_settings_differ_from_the_tuned_ones_and_the_planner_is_frozen() -> None:
    reg = prereg.registered()
    assert len(reg["settings"]) >= 6
    assert set(reg["tuned_on"]["settings"]) == set(run.CHOICE_SETTINGS)
    tuned_model = {"dim": 384, "layers": 6, "heads": 6, "seq_len": 64}
    for name, spec in reg["settings"].items():
        assert spec["model"] != tuned_model, name
        assert spec["model"]["dim"] % spec["model"]["heads"] == 0, name
        s = prereg.parse(name, spec).setting
        tuned = [t for t in run.CHOICE_SETTINGS.values()
                 if (t.nodes, t.per_node, t.mbit, t.accumulation) == (s.nodes, s.per_node, s.mbit, s.accumulation)]
        assert not tuned, f"{name} has the cluster and accumulation of a tuned-on setting"
    assert {spec["per_node"] for spec in reg["settings"].values()} >= {2, 4}
    assert sum(spec["budget_bytes_per_parameter"] is not None for spec in reg["settings"].values()) >= 2
    frozen = reg["planner"]["frozen_at_commit"]
    assert subprocess.run(["git", "cat-file", "-e", f"{frozen}^{{commit}}"], cwd=ROOT).returncode == 0
    tree = subprocess.run(["git", "rev-parse", f"{frozen}:lightning_paro/planner"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert tree == reg["planner"]["paths"]["lightning_paro/planner"]


def _row(tps: float, **kw) -> dict:
    return {"tokens_per_s": tps, "tokens_per_step": 100, "timed_steps": 10, "seconds": 1000 / tps,
            "model_state_bytes_max_rank": kw.pop("mem", 1), **kw}


def test_registered_scoring_counts_the_cold_run_with_its_start_up_and_the_rule_on_measured_fits() -> None:
    runs = {"NNG": {"system": "paro_nng", "error": "memory limit exceeded"},
            "IIG": _row(90.0, mem=3), "IGG": _row(100.0, mem=2), "GGG": _row(50.0, mem=1),
            # 10 steps of 100 tokens in 10 s, plus 2.5 s of probe and plan: 80 tokens/s paid
            "auto_cold": _row(100.0, auto={"in_use": "IGG", "plan_seconds": 2.5, "switches": []}),
            "auto_warm": _row(100.0, auto={"in_use": "IGG", "plan_seconds": 0.0, "switches": []})}
    sc = prereg.score({"runs": runs})
    assert sc["best_fixed"] == "IGG" and sc["exceeded_limit"] == ["NNG"]
    assert sc["rule"] == "IIG" and sc["rule_over_best"] == pytest.approx(0.9)
    assert sc["auto_cold"]["over_best"] == pytest.approx(0.8)
    assert sc["auto_warm"]["over_best"] == pytest.approx(1.0)
    runs["auto_cold"] = {"system": "paro", "error": "memory limit exceeded"}
    assert prereg.score({"runs": runs})["auto_cold"]["over_best"] == 0.0  # a pick over the limit is a miss


def test_registered_table_says_what_has_not_run(tmp_path: Path) -> None:
    text = prereg.table(tmp_path)
    assert text.count("not run") == len(prereg.registered()["settings"])
    assert "Not measured yet" in text


def test_the_budget_of_a_memory_bound_setting_follows_its_parameter_count() -> None:
    n = prereg.parameters({"dim": 32, "layers": 2, "heads": 2, "seq_len": 32})
    from lightning_paro.demo import GPTTask

    assert n == sum(p.numel() for p in GPTTask(dim=32, layers=2, heads=2, seq_len=32).parameters())


def test_accuracy_summary_pairs_seeds_with_fp32() -> None:
    curve = lambda *v: {"held_out": [[10, 9.0], [20, v[0]]]}  # noqa: E731
    runs = {"fp32": {"0": curve(3.0), "1": curve(3.2), "2": curve(3.1)},
            "int8": {"0": curve(3.01), "1": curve(3.22), "2": curve(3.1)},
            "bf16": {"0": curve(3.05)}}
    sm = accuracy.summarise(runs)
    assert sm["fp32"]["final_mean"] == pytest.approx(3.1) and sm["fp32"]["final_sd"] == pytest.approx(0.1)
    assert "diff_mean" not in sm["fp32"]
    assert sm["int8"]["diff_mean"] == pytest.approx(0.01)
    assert sm["int8"]["diff_sd"] == pytest.approx(0.01)
    assert sm["int8"]["diff_se"] == pytest.approx(0.01 / math.sqrt(3))
    assert sm["bf16"]["diff_n"] == 1 and sm["bf16"]["diff_sd"] is None and sm["bf16"]["final_sd"] is None


def test_accuracy_runs_every_option_through_the_worker() -> None:
    assert set(accuracy.OPTIONS) == {"fp32", "bf16", "int8", "int8+ef", "bf16+int8", "ddp_bf16hook", "ddp_powersgd"}
    cmd = accuracy.command("int8+ef", 2, 20, 10, Path("/tmp/x"), accuracy.TINY, 4, 3)
    assert "strategy.error_feedback=true" in cmd and "strategy.inter_quant=int8" in cmd and "run.seed=2" in cmd
    assert "strategy.group_size=2" in cmd and "trainer.devices=4" in cmd
    cmd = accuracy.command("ddp_powersgd", 0, 20, 10, Path("/tmp/x"), accuracy.TINY, 4, 3)
    assert cmd[cmd.index("--anchor") + 1] == "ddp_powersgd" and "strategy=ddp" in cmd
    # one micro-batch per step, set explicitly: the trainer config's default accumulation is 2
    assert "trainer.accumulate_grad_batches=1" in cmd and accuracy.ACCUMULATION == 1


def test_accuracy_refuses_a_curve_off_the_step_grid() -> None:
    on_grid = [[100, 2.7], [200, 2.5], [300, 2.4]]
    assert accuracy.curve_problem(on_grid, 300, 100) is None
    # evaluations one step late after an epoch boundary, and none at the last step
    problem = accuracy.curve_problem([[100, 2.7], [201, 2.5], [301, 2.4]], 300, 100)
    assert problem is not None and "[100, 201, 301]" in problem and "[100, 200, 300]" in problem
    assert accuracy.curve_problem(on_grid[:2], 300, 100) is not None  # the last step not evaluated


def test_powersgd_starts_as_torch_documents() -> None:
    assert anchors.powersgd_start(1000) == 100  # 10% of the run
    assert anchors.powersgd_start(3) == 2  # torch's least with error feedback and warm start


def test_anchor_commands() -> None:
    s = run.COMPRESSION_SETTINGS["2x2-100m-a4"]
    cmd = run.command("ddp_powersgd", s, Path("/tmp/x"))
    assert "--anchor" in cmd and cmd[cmd.index("--anchor") + 1] == "ddp_powersgd" and "bench.warmup_steps=2" in cmd
    cmd = run.command("hsdp_bf16", s, Path("/tmp/x"))
    assert "strategy=fsdp2" in cmd and "bench.warmup_steps=1" in cmd
    assert "bench.warmup_steps=2" in run.command("ddp", s, Path("/tmp/x"), warmup=run.POWERSGD_WARMUP)
    with pytest.raises(SystemExit, match="needs 2 warm-up steps"):
        run.command("ddp_powersgd", s, Path("/tmp/x"), warmup=1)
    cmd = run.command("paro_nig~bf16+int8", s, Path("/tmp/x"), worker=True)
    assert cmd[cmd.index("--anchor") + 1] == "none"
    assert {"strategy=paro_nig", "strategy.param_dtype=bf16", "strategy.inter_quant=int8"} <= set(cmd)
    cmd = run.command("paro_iig", s, Path("/tmp/x"), memory_limit=123)
    assert cmd[cmd.index("--memory-limit") + 1] == "123"
    with pytest.raises(SystemExit, match="no communication variant"):
        run.command("paro_nig~fp8", s, Path("/tmp/x"))
    # the compression table pairs each PaRO option with anchors of the same precision
    for precision, systems in run.PRECISION.items():
        assert any(x.startswith("paro") for x in systems) and any(not x.startswith("paro") for x in systems)


def test_the_compression_and_accuracy_blocks_say_how_to_measure_when_nothing_is_stored() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import results_tables as rt

    for name, path in (("compression", rt.RESULTS / "train" / "compression"),
                       ("accuracy", rt.RESULTS / "train" / "accuracy.json")):
        if not path.exists():
            assert "python -m bench.regenerate --only" in rt.render(name)


def test_accuracy_table_renders_a_stored_file(tmp_path: Path, monkeypatch) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import results_tables as rt

    runs = {"fp32": {"0": {"held_out": [[20, 3.0]]}, "1": {"held_out": [[20, 3.2]]}},
            "int8": {"0": {"held_out": [[20, 3.1]]}, "1": {"held_out": [[20, 3.2]]}}}
    data = {"settings": {"steps": 20, "every": 10, "devices": 4, "group_size": 2, "batch_size": 8,
                         "parameters_label": "tiny GPT"}, "runs": runs, "summary": accuracy.summarise(runs),
            "provenance": {"commit": "abcdef0123", "date": "d", "machine": "m"}}
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "accuracy.json").write_text(json.dumps(data))
    monkeypatch.setattr(rt, "RESULTS", tmp_path)
    text = rt.render("accuracy")
    assert "| int8 | 2 | 3.1500 | 0.0707 | +0.0500 | 0.0707 | 0.0500 |" in text and "abcdef0" in text
    # 2 seeds stored of the grid's 3 per option: the table says the grid is incomplete
    assert f"Incomplete: 4 of the registered grid's {2 * accuracy.SEEDS} runs" in text
    # a third registered option not run yet counts as missing too
    data["settings"]["options"] = {"fp32": [], "int8": [], "bf16": []}
    data["settings"]["accumulation"] = 2
    (tmp_path / "train" / "accuracy.json").write_text(json.dumps(data))
    text = rt.render("accuracy")
    assert f"Incomplete: 4 of the registered grid's {3 * accuracy.SEEDS} runs" in text
    assert "8 sequences per rank per micro-batch, 2 micro-batches per step" in text


def test_compression_table_places_each_option_beside_the_anchors_of_its_precision(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import results_tables as rt

    row = lambda system, tps, nic: {"system": system, "tokens_per_s": tps, "final_loss": 3.9,  # noqa: E731
                                    "nic_inter_bytes_per_step": nic}
    data = {"setting": "2x2-100m-a4", "nodes": 2, "ranks_per_node": 2, "mbit": 100, "accumulation": 4,
            "timed_steps": 2, "provenance": {"commit": "1234567abc", "date": "d", "machine": "m"},
            "rows": [row("ddp", 150.0, 80e6), row("ddp_bf16hook", 250.0, 40e6), row("fsdp2_bf16", 100.0, 90e6),
                     row("paro_nig~bf16", 275.0, 20e6), {"system": "ddp_powersgd", "error": "x"},
                     row("paro_nig~bf16+int8", 300.0, 10e6)]}
    (tmp_path / "train" / "compression").mkdir(parents=True)
    (tmp_path / "train" / "compression" / "2x2-100m-a4.json").write_text(json.dumps(data))
    monkeypatch.setattr(rt, "RESULTS", tmp_path)
    text = rt.render("compression")
    assert "| bf16 | paro_nig~bf16 | 275.0 | 1.10x | 20.00 | 3.9000 | 1 |" in text  # over the bf16-hooked DDP
    assert "| fp32 | ddp | 150.0 | 1.00x | 80.00 |" in text
    assert "| lossy (low-rank or int8 between groups) | ddp_powersgd | failed |" in text
    assert "**4x2-1g-a4**: not measured." in text and "1234567" in text


def test_registered_table_scores_only_complete_settings(tmp_path: Path) -> None:
    name = next(iter(prereg.registered()["settings"]))
    fixed = {k: _row(100.0 + i, mem=1) for i, k in enumerate(prereg.FIXED)}
    auto = {"in_use": "NNG", "plan_seconds": 0.0, "switches": []}
    partial = {"setting": name, "runs": {"auto_cold": _row(100.0, auto=auto), "NNN": _row(100.0)}}
    (tmp_path / f"{name}.json").write_text(json.dumps(partial))
    text = prereg.table(tmp_path)
    assert f"| {name} | incomplete: 1 of 14 fixed strategies run, auto cold run, auto warm not run |" in text
    assert "No setting complete yet" in text and "Within 5%" not in text
    full = {"setting": name, "runs": {**fixed, "auto_cold": _row(113.0, auto=auto), "auto_warm": _row(113.0, auto=auto)}}
    (tmp_path / f"{name}.json").write_text(json.dumps(full))
    text = prereg.table(tmp_path)
    # best fixed: the last of FIXED (113 tokens/s); the rule's NNG: the third (102); auto paid in full: 113
    assert "of 1 settings measured: auto on a cold cache (headline) 1" in text and "the rule 0" in text
    assert f"cold cache {113 / 102:.2f}x" in text
    # auto stopped at the enforced limit in the warm run: a miss in the count, and left out of the mean
    full["runs"]["auto_warm"] = {"system": "paro", "error": "memory limit exceeded"}
    (tmp_path / f"{name}.json").write_text(json.dumps(full))
    text = prereg.table(tmp_path)
    assert f"| {name} | III (113.00) | NNG, 0.00, 1.00 | memory limit exceeded | NNG, 0.90 |" in text
    assert "auto on a warm cache 0" in text and "warm cache —" in text
    assert f"Runs of auto that stopped without a result (warm in {name}) are misses" in text


def test_resuming_a_complete_setting_runs_nothing_and_keeps_its_provenance(tmp_path: Path, monkeypatch) -> None:
    # the stored provenance names the commit the runs were made at; a later resume must not restamp it
    name = next(n for n, s in prereg.registered()["settings"].items() if s["budget_bytes_per_parameter"] is None)
    runs = {**{k: _row(100.0) for k in prereg.FIXED}, "auto_cold": _row(90.0), "auto_warm": _row(95.0)}
    stored = json.dumps({"setting": name, "runs": runs, "provenance": {"commit": "0" * 40}}, indent=2)
    (tmp_path / f"{name}.json").write_text(stored)
    monkeypatch.setenv("LIGHTNING_PARO_CACHE_DIR", str(tmp_path / "cache"))  # restored after: run_setting sets it
    monkeypatch.setattr(prereg, "run_one", lambda *a, **k: pytest.fail("a complete setting ran again"))
    args = argparse.Namespace(passes=1, fixed=",".join(prereg.FIXED), timeout=1, model_scale="registered")
    prereg.run_setting(prereg.parse(name, prereg.registered()["settings"][name]), args, tmp_path, {})
    assert (tmp_path / f"{name}.json").read_text() == stored
