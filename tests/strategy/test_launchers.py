"""The strategy launches the ways Lightning users launch: its subprocess launcher (like "ddp"), spawn, torchrun,
and several nodes with NODE_RANK; validate/test/predict with uneven batch counts across ranks neither hang nor crash."""

import json
import os
import subprocess
import sys

import pytest
from launch import WORKERS, free_port, wait_all

SCRIPT = str(WORKERS / "launch_modes.py")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _run(cmds, timeout=240):
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd, env in cmds]
    return wait_all(procs, timeout)


def _results(out, mode, world):
    return [json.loads((out / f"{mode}.{r}.json").read_text()) for r in range(world)]


def _check(results, world, group_size, sharding, evaluated=True):
    for r, res in enumerate(results):
        assert (res["world"], res["group_size"], res["sharding"]) == (world, group_size, sharding)
        assert res["num_groups"] == world // group_size
        assert len(res["losses"]) == 3 and res["steps_logged"] == 3
        if evaluated:
            assert res["val_batches"] == res["test_batches"] == 2 + r  # uneven across ranks
            assert 0.0 <= res["val_acc"] <= 1.0
        assert res["predict_batches"] == 1 + r
    # replicas end identical
    assert len({round(res["checksum"], 6) for res in results}) == 1


@pytest.mark.timeout(300)
def test_subprocess_launcher(tmp_path):
    _run([([sys.executable, SCRIPT, "popen", str(tmp_path)], _env(MASTER_PORT=str(free_port())))])
    _check(_results(tmp_path, "popen", 2), world=2, group_size=2, sharding="NIG")
    # per-step traffic reaches Lightning's loggers
    import csv

    rows = [r for r in csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")) if r["paro/intra_bytes"]]
    assert len(rows) == 3
    assert all(float(r["paro/intra_bytes"]) > 0 and float(r["paro/inter_bytes"]) == 0 for r in rows)  # one group


@pytest.mark.timeout(300)
def test_spawn(tmp_path):
    """Fit, then predict in new workers with the module the parent recovered from fit's (each spawned stage imports
    torch and Lightning anew, so validate and test, which take predict's path, are checked under the other modes)."""
    _run([([sys.executable, SCRIPT, "spawn", str(tmp_path)], _env(MASTER_PORT=str(free_port())))])
    _check(_results(tmp_path, "spawn", 2), world=2, group_size=2, sharding="IGG", evaluated=False)


@pytest.mark.timeout(300)
def test_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           f"--master_port={free_port()}", SCRIPT, "torchrun", str(tmp_path)]
    _run([(cmd, _env())])
    _check(_results(tmp_path, "torchrun", 2), world=2, group_size=2, sharding="GGG")


@pytest.mark.timeout(300)
def test_two_nodes_with_node_rank(tmp_path):
    """num_nodes=2 x devices=2: the group size defaults to the processes per node, so 2 groups of 2."""
    port = str(free_port())
    cmds = [([sys.executable, SCRIPT, "multinode", str(tmp_path)],
             _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))) for node in range(2)]
    _run(cmds)
    _check(_results(tmp_path, "multinode", 4), world=4, group_size=2, sharding="IIG")
