"""Fixtures for the batch-prediction tests: a throwaway PostgreSQL server and ledger locations."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PG_ENV = "LIGHTNING_PARO_TEST_PG_URL"


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL URL: the one exported by the caller, or a server started (and stopped) here."""
    url = os.environ.get(PG_ENV)
    started_here = False
    if not url:
        proc = subprocess.run(
            ["bash", str(REPO / "scripts" / "postgres.sh")], capture_output=True, text=True, timeout=600
        )
        line = next((l for l in proc.stdout.splitlines() if PG_ENV in l), None)
        if proc.returncode != 0 or line is None:
            message = f"PostgreSQL could not be started by scripts/postgres.sh: {proc.stderr.strip()[-2000:]}"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(message)
            pytest.skip(message)
        url = line.split("=", 1)[1].strip().strip("'")
        started_here = True
    yield url
    if started_here:
        subprocess.run(["bash", str(REPO / "scripts" / "postgres.sh"), "stop"], capture_output=True, timeout=120)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_location(request, tmp_path):
    """A fresh ledger location on each backend; each test gets its own job name too."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.sqlite")
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def job_name():
    return f"job-{uuid.uuid4().hex[:12]}"
