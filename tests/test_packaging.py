"""The built wheel, as a user installs it: built without deprecation banners, imported from another directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the environment's setuptools builds it, so the test needs no package index.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                           str(ROOT)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("lightning_paro-*.whl")
    return built, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_wheel_builds_without_deprecation_banners(wheel):
    _, log = wheel
    assert "deprecated" not in log.lower(), log


@pytest.mark.timeout(300)
def test_installed_wheel_registers_the_strategies_from_another_directory(wheel, tmp_path):
    built, _ = wheel
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(built)],
                   check=True, capture_output=True, timeout=240)
    script = (
        "import lightning as L, lightning_paro\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print(lightning_paro.__file__)\n"
        "print(sorted(k for k in StrategyRegistry if k.startswith('paro')))\n"
        "t = L.Trainer(strategy='paro_iig', accelerator='cpu', devices=1, logger=False)\n"
        "print(type(t.strategy).__name__, t.strategy.sharding.name)\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    where, names, built_strategy = proc.stdout.strip().splitlines()[-3:]
    assert where.startswith(str(target))  # the installed copy, not the source tree
    assert len(eval(names)) == 15  # "paro" and the 14 strategies
    assert built_strategy == "PaROStrategy IIG"
