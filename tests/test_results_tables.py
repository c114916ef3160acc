"""The results tables of README.md and docs/*.md are what bench/results_tables.py renders from the stored results
files, and every results file records where it came from (commit, date, machine). Nothing here runs a benchmark."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import provenance  # noqa: E402
import regenerate  # noqa: E402
import results_tables as rt  # noqa: E402

RESULT_DIRS = ("train", "auto", "collectives")
"""The results folders whose tables are rendered here; another area's folder joins through its renderer's sources."""


def results_files() -> list[Path]:
    files = {p for d in RESULT_DIRS for p in (rt.RESULTS / d).rglob("*.json")}
    for r in rt.registry().values():
        for pattern in r.sources:
            files |= set(rt.RESULTS.glob(pattern))
    return sorted(files)


def test_every_marked_block_equals_what_the_stored_results_render() -> None:
    stale = rt.stale()
    assert not stale, ("results blocks that differ from the stored files (run `python -m bench.regenerate"
                       f" --render-only`): {[(str(p.relative_to(ROOT)), n) for p, n in stale]}")


def test_the_docs_have_the_tables_of_every_area() -> None:
    names = {n for p in rt.DOCS for n, _ in rt.blocks(p.read_text())}
    assert {"train-sweep", "train-memory", "compression", "accuracy", "auto-choice", "auto-preregistered",
            "collectives-targets"} <= names
    unknown = names - set(rt.registry())
    assert not unknown, f"blocks without a renderer: {unknown}"


def test_a_number_typed_into_a_block_is_found() -> None:
    readme = (ROOT / "README.md").read_text()
    name, body = next((n, b) for n, b in rt.blocks(readme) if n == "train-memory")
    digit = next(i for i, c in enumerate(body) if c.isdigit() and c != "9")
    edited = body[:digit] + "9" + body[digit + 1:]
    assert rt.render(name) == body
    assert rt.rendered(readme.replace(body, edited)) == readme  # rendering puts the stored figure back


def test_every_results_file_records_commit_date_and_machine() -> None:
    files = results_files()
    assert len(files) > 50
    lacking = {str(p.relative_to(rt.RESULTS)): provenance.missing(json.loads(p.read_text())) for p in files}
    lacking = {k: v for k, v in lacking.items() if v}
    assert not lacking, f"results files without provenance: {lacking}"


def test_two_renderers_of_one_name_are_refused() -> None:
    @rt.renderer("test-only-block", sources=())
    def first() -> str:
        return "a"

    try:
        with pytest.raises(ValueError, match="two renderers named 'test-only-block'"):
            @rt.renderer("test-only-block", sources=())
            def second() -> str:
                return "b"
        assert rt.rendered("x\n<!-- results:test-only-block -->\nold\n<!-- /results:test-only-block -->\n") == \
            "x\n<!-- results:test-only-block -->\na\n<!-- /results:test-only-block -->\n"
    finally:
        del rt.RENDERERS["test-only-block"]


def test_regenerate_lists_every_benchmark_and_runs_nothing_on_a_dry_run(capsys: pytest.CaptureFixture) -> None:
    assert list(regenerate.steps()) == ["train", "memory", "compression", "accuracy", "auto", "collectives",
                                        "predict"]
    regenerate.main(["--dry-run", "--only", "compression,accuracy"])
    out = capsys.readouterr().out
    assert "bench/train/run.py --set compression --fresh --more 3" in out
    assert "bench/train/accuracy.py --seeds 3 --steps 1000 --every 100" in out
    with pytest.raises(SystemExit, match="no step nope"):
        regenerate.main(["--dry-run", "--only", "nope"])


def test_regenerate_stamps_what_a_step_wrote_without_provenance(tmp_path: Path, monkeypatch) -> None:
    import time

    monkeypatch.setattr(regenerate, "ROOT", tmp_path)
    out = tmp_path / "bench" / "results" / "x"
    out.mkdir(parents=True)
    since = time.time() - 1
    (out / "new.json").write_text(json.dumps({"rows": [1]}))
    (out / "listed.json").write_text(json.dumps([1, 2]))
    kept = {"rows": [], "provenance": {"commit": "abc", "date": "d", "machine": "m"}}
    (out / "kept.json").write_text(json.dumps(kept))
    step = regenerate.Step("x", (), results=("x/*.json",))
    stamped = regenerate.stamp_written(step, since)
    assert sorted(p.name for p in stamped) == ["listed.json", "new.json"]
    assert json.loads((out / "listed.json").read_text())["rows"] == [1, 2]
    assert not provenance.missing(json.loads((out / "new.json").read_text()))
    assert json.loads((out / "kept.json").read_text()) == kept


def test_provenance_names_the_checkout_commit() -> None:
    import subprocess

    s = provenance.stamp()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert s["commit"] == head and s["date"] and s["machine"]["cpus_usable"] >= 1
    assert provenance.missing({"provenance": {"commit": "x", "date": "y"}}) == ["machine"]
    assert provenance.missing([]) == ["commit", "date", "machine"]
