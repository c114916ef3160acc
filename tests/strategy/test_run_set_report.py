"""The run set's scoring (bench/train/auto_report.py ``run_set``) on results made by hand.

Every run of ``auto`` below times 10 steps of 100 tokens (1,000 tokens); its tokens/s with the start-up paid is
1,000 / (window + start-up). The best fixed strategy (NNG) ran 100, 110, 90, 105 and 95 tokens/s: median of the
five 100, of the first three 100.

| setting | auto's runs: window + start-up (s), links from          | over 100 tokens/s                 | median |
|---------|----------------------------------------------------------|-----------------------------------|--------|
| five    | 10 + 1.11 probe; 10.4, 9.7, 9.9, 10.0 each + 0.3 cache   | 0.900, 0.935, 1.000, 0.980, 0.971 | 0.971  |
|         | the first three alone                                    | 0.900, 0.935, 1.000               | 0.935  |
| three   | 10 + 0.4 probe; 10 + 0.2, 10 + 0.3 cache                 | 0.962, 0.980, 0.971               | 0.971  |
| not-fit | as "three", but its first run picks NNN, which does not fit |                                | 0.971  |

So: within 5% (median, fitting picks only) in "five" and "three"; the first three runs alone only in "three"; the
first run (the whole probe) only in "three" (0.962).
"""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "train"


@pytest.fixture
def auto_report(monkeypatch):
    monkeypatch.syspath_prepend(str(_BENCH))  # it imports its neighbours choice.py and run.py by name
    spec = importlib.util.spec_from_file_location("bench_train_auto_report", _BENCH / "auto_report.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _auto_run(window: float, start_up: float, source: str, pick: str = "NNG") -> dict:
    note = "links from the link cache, checked" if source == "cache" else "links measured by the start-up probe"
    return {"tokens_per_step": 100, "timed_steps": 10, "seconds": window, "tokens_per_s": 1000 / window,
            "auto": {"in_use": pick, "plan_seconds": start_up, "switches": [], "notes": [note]}}


def _write(folder: Path, name: str, fixed: list[float], auto: list[dict]) -> None:
    median = sorted(fixed)[len(fixed) // 2]
    rows = [{"system": "paro_nng", "tokens_per_s": median, "runs": [{"tokens_per_s": t} for t in fixed]},
            {"system": "paro", **auto[0], "runs": auto}]
    (folder / f"{name}.json").write_text(json.dumps({"setting": name, "rows": rows}))


def test_the_run_set_scores_medians_of_every_run_and_of_the_first_three_apart(auto_report, tmp_path, monkeypatch):
    fixed = [100.0, 110.0, 90.0, 105.0, 95.0]
    _write(tmp_path, "five", fixed, [_auto_run(10, 1.11, "probe"), _auto_run(10.4, 0.3, "cache"),
                                     _auto_run(9.7, 0.3, "cache"), _auto_run(9.9, 0.3, "cache"),
                                     _auto_run(10.0, 0.3, "cache")])
    three = [_auto_run(10, 0.4, "probe"), _auto_run(10, 0.2, "cache"), _auto_run(10, 0.3, "cache")]
    _write(tmp_path, "three", fixed[:3], three)
    _write(tmp_path, "not-fit", fixed[:3], [_auto_run(10, 0.4, "probe", "NNN"), *three[1:]])
    monkeypatch.setattr(auto_report, "RUN_RESULTS", tmp_path)
    monkeypatch.setattr(auto_report, "RUN_SETTINGS", {n: SimpleNamespace(timed_steps=10)
                                                      for n in ("five", "three", "not-fit")})
    fits = {"five": frozenset({"NNG"}), "three": frozenset({"NNG"}), "not-fit": frozenset({"NNG"})}

    lines, out = auto_report.run_set(fits)

    settings = out["settings"]
    assert settings["five"]["auto_over_best_paid"] == [0.9, 0.935, 1.0, 0.98, 0.971]
    assert settings["five"]["median"] == 0.971 and settings["five"]["first_run_whole_probe"] == 0.9
    assert settings["three"]["auto_over_best_paid"] == [0.962, 0.98, 0.971]
    assert out["within_5pct"] == ["five", "three"]  # not-fit: as fast, but its first pick does not fit
    assert out["within_5pct_first_three_runs"] == ["three"]
    assert out["within_5pct_first_run"] == ["three"]
    assert any("in 2 of 3 settings (not-fit missed)" in line for line in lines)
    assert any("first three runs of each system alone (medians of 3): within 5% in 1 of 3 (five, not-fit missed)"
               in line for line in lines)
