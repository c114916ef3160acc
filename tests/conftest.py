import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# sharding="auto" stores the links it probed (planner/link_cache.py): never in the user's own cache, also not from
# fixtures that start jobs before a test's own directory is set (below)
os.environ["LIGHTNING_PARO_CACHE_DIR"] = _LINK_CACHE = tempfile.mkdtemp(prefix="paro-link-cache-")
atexit.register(shutil.rmtree, _LINK_CACHE, True)
sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_environment():
    """Put ``os.environ`` back after every test. Lightning's in-process set-up writes ``MASTER_PORT`` (and the store
    keeps that port open in this process); a later test's subprocess inheriting it would fail with EADDRINUSE."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _own_link_cache(tmp_path_factory):
    """Each test gets an empty link cache (``sharding="auto"`` stores the links it probed there), so no test reuses
    links another one measured; two fits within a test share it, as two jobs of a user do."""
    os.environ["LIGHTNING_PARO_CACHE_DIR"] = str(tmp_path_factory.mktemp("link-cache"))
    yield


@pytest.fixture
def world_of_one(monkeypatch):
    """A Communicator over a world of one CPU process, with its own default group (so its communication thread is
    not shared with other tests)."""
    import torch
    import torch.distributed as dist
    from launch import free_port

    from lightning_paro.comm.collectives import Communicator
    from lightning_paro.comm.topology import Topology

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield Communicator(Topology.from_process_group(), device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def auto_fits(tmp_path_factory):
    """One launch of ``workers/auto_fits.py`` on two processes for the tests of ``sharding="auto"`` that need two:
    its output (one text per rank) and a loader of ``SUB/NAME.RANK.json`` for both ranks (``load.dir``: the output
    directory)."""
    import json

    from launch import launch

    out = tmp_path_factory.mktemp("auto_fits")
    logs = launch("auto_fits.py", 2, str(out), timeout=300)

    def load(sub, name):
        return [json.loads((out / sub / f"{name}.{r}.json").read_text()) for r in range(2)]

    load.dir = out
    return logs, load
