import pytest


@pytest.fixture(autouse=True)
def _launch_time(monkeypatch):
    # main() records the launch time in os.environ for the processes it starts; keep that out of later tests
    monkeypatch.setenv("LIGHTNING_PARO_LAUNCH_TIME", "1700000000")
