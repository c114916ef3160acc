"""The private torch and Lightning APIs the package relies on are listed in one place, present in the versions the
suite runs on, and a version without one fails with a message naming it."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_paro import compat


def test_every_private_api_is_present_in_the_installed_versions():
    assert compat.missing_private_apis() == []
    compat.check_private_apis()
    assert {api.area for api in compat.PRIVATE_APIS} == {"predict", "strategy", "checkpoint", "cli"}


def test_a_missing_api_fails_naming_it_its_user_and_the_versions(monkeypatch):
    gone = dataclasses.replace(compat.PRIVATE_APIS[0], probe=lambda: (_ for _ in ()).throw(AttributeError("x")))
    monkeypatch.setattr(compat, "PRIVATE_APIS", (gone, *compat.PRIVATE_APIS[1:]))
    with pytest.raises(compat.IncompatibleVersionError) as info:
        compat.check_private_apis()
    text = str(info.value)
    assert gone.name in text and "ElasticPredict.setup" in text
    assert "torch 2.13" in text and "lightning 2.6" in text
    compat.check_private_apis(["strategy", "checkpoint"])  # other areas are unaffected


def test_the_declared_lower_bounds_are_the_tested_versions():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    declared = {d.split(">=")[0].strip(): d.split(">=")[1].split(",")[0].strip() for d in project["dependencies"]
                if ">=" in d}
    for package, tested in compat.TESTED_VERSIONS.items():
        assert declared[package] == tested, (package, declared[package])
    installed = compat.installed_versions()
    for package, tested in compat.TESTED_VERSIONS.items():
        assert installed[package].startswith(tested), (package, installed[package])
