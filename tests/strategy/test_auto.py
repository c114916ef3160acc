"""sharding="auto": the plan's table and choice, the link fit, memory reading, the model description, the plan
command, and the start-up probe on 4 gloo processes (2 groups of 2)."""

import dataclasses
import json
import math

import pytest
import torch
from launch import launch
from torch import nn

from lightning_paro.plan import main as plan_main
from lightning_paro.planner import (
    Cluster,
    Compute,
    Link,
    MeasuredLinks,
    Workload,
    available_host_memory,
    device_memory_bytes,
    fit_link,
    format_bytes,
    format_plan,
    large_gather_bytes,
    memory_budget_bytes,
    optimizer_states_per_param,
    overlap_from_times,
    plan,
    workload_from_module,
)
from lightning_paro.planner.link_cache import (
    CachedLinks,
    cache_dir,
    cache_key,
    checks_agree,
    links_from_json,
    links_to_json,
    read_cached,
    read_record,
    store_update,
    updates_from_json,
    write_cached,
)
from lightning_paro.planner.measure import update_key
from lightning_paro.strategy.levels import VALID_STRATEGIES

W = Workload(1e9, 1e9, accumulation=4, num_units=16, root_fraction=0.05, tokens_per_micro_batch=1024,
             param_bytes=2, grad_bytes=2, optim_bytes=12)
C = Cluster(16, 4, Link.gbit(800, 5), Link.gbit(10, 30), 16e9)
COMPUTE = Compute(flops_per_second=50e12, memory_bandwidth=1e12)


def test_plan_picks_the_fastest_that_fits():
    p = plan(W, C, COMPUTE, memory_budget=0.5)
    assert p.budget_bytes == 8e9
    assert sorted(c.strategy for c in p.candidates) == sorted(VALID_STRATEGIES)
    times = [c.prediction.step_seconds for c in p.candidates]
    assert times == sorted(times)
    for c in p.candidates:
        assert c.fits == (c.prediction.memory.total <= 8e9)
    fitting = [c for c in p.candidates if c.fits]
    assert p.choice == fitting[0].strategy and "chosen" in p.candidate(p.choice).why
    assert all("does not fit" in c.why for c in p.candidates if not c.fits)
    assert p.choice in p.reason


def test_memory_budget_fraction_or_bytes():
    assert memory_budget_bytes(0.25, 8e9) == 2e9
    assert memory_budget_bytes(3e9, 8e9) == 3e9
    for bad in (0, -1, True, "half"):
        with pytest.raises(ValueError, match="memory_budget"):
            memory_budget_bytes(bad, 8e9)


def test_strategies_can_be_restricted_and_nothing_fitting_says_what_to_change():
    p = plan(W, C, COMPUTE, memory_budget=1e6, strategies=("nnn", "ggg"))
    assert sorted(c.strategy for c in p.candidates) == ["GGG", "NNN"]
    assert p.choice is None and "GGG" in p.reason and "Raise memory_budget" in p.reason


def test_format_plan_lists_every_candidate_and_the_choice():
    p = plan(W, C, COMPUTE)
    text = format_plan(p)
    assert all(s in text for s in VALID_STRATEGIES) and f"choice: {p.choice}." in text
    md = format_plan(p, markdown=True)
    assert sum(line.startswith("| ") for line in md.splitlines()) == 1 + 14  # header and one row per strategy
    assert "|---|" in md


def test_format_bytes():
    assert [format_bytes(b) for b in (13.5e9, 612e3, 12, 2.5e12)] == ["13.5 GB", "612 kB", "12 B", "2.5 TB"]


def test_large_probe_gathers_are_sized_to_the_link():
    # 2 ranks, a 1 MiB pilot: each rank's link carries half of it, 524,288 B. On 100 Mbit/s shared by two ranks
    # (6.25 MB/s each) beyond 2 ms of latency it takes 2 ms + 83.9 ms; what that rate moves in 0.1 s is 625,000 B on
    # the link, a gather of 1,250,000 B
    pilot = 2**20
    assert large_gather_bytes(pilot, 0.002 + 0.0838861, 0.002, 0.1, 4 * 2**20) == pytest.approx(1_250_000, rel=1e-4)
    # a fast link would want 10x the cap: the cap; a pilot slower than the target: never below the pilot's size
    assert large_gather_bytes(pilot, 0.0011, 0.001, 0.1, 4 * 2**20) == 4 * 2**20
    assert large_gather_bytes(pilot, 0.5, 0.001, 0.1, 4 * 2**20) == pilot
    # the pilot no slower than the small gather (noise): as fast as can be, the cap
    assert large_gather_bytes(pilot, 0.001, 0.002, 0.1, 4 * 2**20) == 4 * 2**20


def test_link_cache_key_record_and_check():
    key = cache_key(["a", "a", "b", "b"], 2, "gloo", "cpu", 2**20, 4 * 2**20)
    assert key == cache_key(["a", "a", "b", "b"], 2, "gloo", "cpu", 2**20, 4 * 2**20)
    # another host order (other ranks share a host), group size, backend or chunk is another cluster layout
    assert len({key, cache_key(["a", "b", "a", "b"], 2, "gloo", "cpu", 2**20, 4 * 2**20),
                cache_key(["a", "a", "b", "b"], 4, "gloo", "cpu", 2**20, 4 * 2**20),
                cache_key(["a", "a", "b", "b"], 2, "nccl", "cuda", 2**20, 4 * 2**20),
                cache_key(["a", "a", "b", "b"], 2, "gloo", "cpu", 2**19, 4 * 2**20)}) == 5
    links = MeasuredLinks(Link(2e9, 1e-5, 0.5), Link(1e8, 2e-4, 1.0), 1.3, 0.9, (4 * 2**20, 1_250_000), (0.02, 0.09))
    assert links_from_json(json.loads(json.dumps(links_to_json(links)))) == links
    record = links_to_json(links)
    assert links_from_json({**record, "format": record["format"] + 1}) is None  # another version's record
    assert links_from_json({k: v for k, v in record.items() if k != "inter"}) is None
    assert links_from_json("not a record") is None
    assert links_from_json({**record, "intra": {**record["intra"], "bandwidth": -1.0}}) is None  # Link refuses it
    assert links_from_json({**record, "hierarchical_factor": 0.0}) is None
    assert links_from_json({**record, "check_bytes": [-1, 1_250_000]}) is None
    assert links_from_json({k: v for k, v in record.items() if k != "check_seconds"}) is None
    # hand-made: 0.09 s stored, 0.1 s now: 1.11x, kept; 0.2 s now: 2.22x, over the 2x tolerance
    agree, ratios = checks_agree((0.02, 0.09), (0.03, 0.1))
    assert agree and ratios == pytest.approx([1.5, 0.1 / 0.09])
    assert not checks_agree((0.02, 0.09), (0.02, 0.2))[0]
    assert not checks_agree((0.02, 0.09), (0.02, 0.04))[0]  # faster by more than 2x: also another fabric
    assert checks_agree((0.02, 0.0), (0.02, 0.0)) == (True, [1.0])  # one group: no inter-group link
    assert not checks_agree((0.02, 0.0), (0.02, 0.1))[0]


def test_link_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_PARO_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("LIGHTNING_PARO_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lightning_paro"
    path = tmp_path / "xdg" / "lightning_paro" / "links-x.json"
    links = MeasuredLinks(Link(2e9), Link(1e8), check_bytes=(4 * 2**20, 1_250_000), check_seconds=(0.02, 0.09))
    write_cached(path, links)  # creates the directory; no temporary file left
    assert read_cached(path) == links and [p.name for p in path.parent.iterdir()] == ["links-x.json"]
    path.write_text("{half a rec")
    assert read_cached(path) is None


def test_link_cache_keeps_update_bandwidths_with_the_links(monkeypatch, tmp_path):
    links = MeasuredLinks(Link(2e9), Link(1e8), check_bytes=(4 * 2**20, 1_250_000), check_seconds=(0.02, 0.09))
    path = tmp_path / "links-x.json"
    write_cached(path, links)
    assert read_record(path) == (links, {})
    # a figure measured now is added to the record the links came from (rank 0 writes; one process: rank 0)
    monkeypatch.setattr("torch.distributed.get_rank", lambda group=None: 0)
    found = CachedLinks(links, "cache", "note", {}, path)
    store_update(found, "AdamW float32 foreach=None fused=None", 3.5e9)
    store_update(found, "SGD float32 foreach=None fused=None", 9e9)
    assert read_record(path) == (links, {"AdamW float32 foreach=None fused=None": 3.5e9,
                                         "SGD float32 foreach=None fused=None": 9e9})
    # links probed again replace the record, and the update figures of the old links with it
    write_cached(path, links)
    assert read_record(path)[1] == {}
    # the cache off (no record): nothing written
    store_update(CachedLinks(links, "probe", "note"), "AdamW float32 foreach=None fused=None", 1.0)
    # figures that are not positive numbers are not used
    assert updates_from_json({"updates": {"a": 2e9, "b": -1, "c": 0}}) == {"a": 2e9}
    assert updates_from_json({"updates": {"a": "fast"}}) == {} and updates_from_json("no record") == {}
    # the figure's name: optimizer class, the shards' dtype, foreach and fused
    w32 = Workload(1e6, 1e6, param_bytes=4, grad_bytes=4, optim_bytes=8)
    w64 = dataclasses.replace(w32, param_bytes=8)
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=False)
    assert update_key(adam, w32) == "AdamW float32 foreach=False fused=None"
    assert update_key(adam, w64) == "AdamW float64 foreach=False fused=None"
    assert update_key(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), w32).startswith("SGD float32")


def test_fit_link_recovers_alpha_and_beta():
    link = Link(2e9, 5e-5)
    k = 4

    def t(nbytes):
        return (k - 1) * link.latency + (k - 1) / k * nbytes / link.bandwidth

    fitted = fit_link(k, 4096, t(4096), 4 * 2**20, t(4 * 2**20))
    assert fitted.bandwidth == pytest.approx(2e9) and fitted.latency == pytest.approx(5e-5)
    noisy = fit_link(k, 4096, 1.0, 4 * 2**20, 0.5)  # large no slower than small: bandwidth from the large alone
    assert noisy.latency == 0 and noisy.bandwidth == pytest.approx(0.75 * 4 * 2**20 / 0.5)


def test_overlap_from_times():
    assert overlap_from_times(compute=1.0, comm=0.5, both=1.0) == 1.0  # the transfer hid completely
    assert overlap_from_times(compute=1.0, comm=0.5, both=1.5) == 0.0  # the two added up
    assert overlap_from_times(compute=1.0, comm=0.5, both=1.2) == pytest.approx(0.6)
    assert overlap_from_times(compute=1.0, comm=0.5, both=2.0) == 0.0  # slowed each other further: clamped
    assert overlap_from_times(compute=1.0, comm=0.5, both=0.9) == 1.0  # noise below the longer one: clamped
    assert overlap_from_times(compute=0.0, comm=0.5, both=0.5) == 1.0  # nothing to hide behind


def test_host_memory_is_shared_by_the_ranks_on_it(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       25165824 kB\nMemFree:         1000 kB\nMemAvailable:   20971520 kB\n")
    assert available_host_memory(info) == 20 * 2**30
    (tmp_path / "bad").write_text("MemTotal: 1 kB\n")
    with pytest.raises(RuntimeError, match="device_memory"):
        available_host_memory(tmp_path / "bad")
    assert 0 < device_memory_bytes("cpu", 4) <= available_host_memory() // 4 + 1
    with pytest.raises(ValueError, match="device_memory"):
        device_memory_bytes("meta")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 10, bias=False)


def test_workload_from_module_matches_the_engine_view():
    net = Net()
    net.blocks[2].requires_grad_(False)
    opt = torch.optim.AdamW(p for p in net.parameters() if p.requires_grad)
    w = workload_from_module(net, [opt], accumulation=3)
    block = 8 * 16 + 16 + 16 * 8 + 8
    assert w.num_params == 80 + 3 * block + 80 and w.num_trainable == 80 + 2 * block + 80
    assert w.num_units == 3 and w.root_fraction == pytest.approx(160 / w.num_params)
    assert (w.param_bytes, w.grad_bytes, w.optim_bytes, w.accumulation) == (4, 4, 8, 3)
    net16 = Net().to(torch.bfloat16)
    w16 = workload_from_module(net16, [torch.optim.Adam(net16.parameters())])
    assert (w16.param_bytes, w16.optim_bytes) == (2, 12)  # fp32 Adam states and a separate fp32 master
    assert w16.num_trainable == w16.num_params
    frozen = workload_from_module(Net(), [])
    assert frozen.num_trainable == 0 and frozen.optim_bytes == 0
    assert w.backward_units == 3  # a trainable embedding before the units: backward reaches the first unit


def test_workload_from_module_counts_the_units_backward_runs_through():
    net = Net()
    net.requires_grad_(False)
    net.blocks[2].requires_grad_(True)  # only the last block trains: backward stops there
    w = workload_from_module(net, [torch.optim.AdamW(net.blocks[2].parameters())])
    assert w.num_units == 3 and w.backward_units == 1
    net.blocks[1].requires_grad_(True)
    net.head.requires_grad_(True)  # registered after the units: used after them
    w = workload_from_module(net, [torch.optim.AdamW(p for p in net.parameters() if p.requires_grad)])
    assert w.backward_units == 2


def test_plan_for_job_with_everything_given_needs_no_collectives():
    from lightning_paro.comm.topology import Topology
    from lightning_paro.planner import AutoConfig, plan_for_job

    net = Net()
    opt = torch.optim.AdamW(net.parameters())
    config = AutoConfig(memory_budget=0.5, intra=Link.gbit(100), inter=Link.gbit(1, 50), device_memory=1e9,
                        micro_step_seconds=1e-3, reduce_scatter_factor=2.0, memory_bandwidth=1e11)
    p = plan_for_job(net, [opt], Topology(8, 4, rank=5), "cpu", accumulation=4, ranks_on_host=4, config=config)
    assert (p.cluster.world_size, p.cluster.group_size, p.cluster.reduce_scatter_factor) == (8, 4, 2.0)
    assert p.budget_bytes == 5e8 and p.workload.accumulation == 4 and p.workload.num_units == 3
    assert p.choice in VALID_STRATEGIES and "No compute time" not in p.reason


def test_auto_sizes_the_ho_ring_chunk_to_the_links_and_the_strategy_uses_it():
    from lightning_paro.comm.topology import Topology
    from lightning_paro.planner import AutoConfig, plan_for_job
    from lightning_paro.strategy.strategy import PaROStrategy

    # 2 blocks of 1.3e8 parameters on the meta device (nothing allocated), 16 groups of 8 on fast, high-latency links
    net = nn.Sequential(*[nn.Linear(8192, 16384, device="meta") for _ in range(2)])
    opt = torch.optim.AdamW(net.parameters())
    config = AutoConfig(intra=Link.gbit(2400, 10), inter=Link.gbit(50, 20), device_memory=80e9,
                        micro_step_seconds=1.0, memory_bandwidth=1e12)
    units = [nn.Linear]
    p = plan_for_job(net, [opt], Topology(128, 8, rank=3), "cpu", accumulation=4, ranks_on_host=8, units=units,
                     config=config)
    # By hand: a unit is X = 4 x (8192 x 16384 + 16384) = 537 MB; its global all-reduce's inter phase over 16 groups
    # sends 2 x 15/16 x X / 8 = 126 MB (20.1 ms at 6.25 GB/s) and pays 30 steps x 20 us / 2 = 0.3 ms per chunk of
    # latency: 77 ms in 256 chunks of 2 MiB, 38 ms in 128 of 4 MiB, 19 ms in 64 of 8 MiB (bandwidth-bound from there);
    # a larger chunk only adds to the intra phases' share of one chunk (3.1 ms / chunks): 8 MiB.
    assert p.cluster.chunk_bytes == 8 * 2**20 and "chunks of 8 MiB" in format_plan(p)
    given = plan_for_job(net, [opt], Topology(128, 8, rank=3), "cpu", accumulation=4, ranks_on_host=8, units=units,
                         config=config, chunk_bytes=2**20)
    assert given.cluster.chunk_bytes == 2**20
    # the strategy's HO-Rings: the chunk given, else the planned one under sharding="auto", else the default 2 MiB
    auto = PaROStrategy(sharding="auto")
    assert auto._ho_ring_config().chunk_bytes == 2 * 2**20
    auto.auto_plan = p
    assert auto._ho_ring_config().chunk_bytes == p.cluster.chunk_bytes
    assert PaROStrategy(sharding="auto", chunk_bytes=2**20)._ho_ring_config().chunk_bytes == 2**20
    assert PaROStrategy(sharding="IIG")._ho_ring_config().chunk_bytes == 2 * 2**20


def test_optimizer_states_per_param():
    p = [nn.Parameter(torch.zeros(2))]
    assert optimizer_states_per_param(torch.optim.SGD(p, lr=0.1)) == 0
    assert optimizer_states_per_param(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == 1
    assert optimizer_states_per_param(torch.optim.AdamW(p)) == 2
    assert optimizer_states_per_param(torch.optim.RMSprop(p, momentum=0.9, centered=True)) == 3


def test_plan_command(capsys):
    argv = ["--params", "7e9", "--trainable", "1.0", "--nodes", "4", "--gpus-per-node", "8", "--intra-gbps", "2400",
            "--inter-gbps", "200", "--device-memory-gib", "80", "--accumulate", "4", "--tflops", "125"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert all(s in out for s in VALID_STRATEGIES) and "choice: " in out and "n=32 ranks in groups of m=8" in out
    # 200 Gbit/s per rank: the largest unit is the root, 2 x 0.04 x 7e9 = 560 MB; its global all-reduce's inter phase
    # over 4 groups sends 2 x 3/4 x 560 MB / 8 = 105 MB (4.2 ms at 25 GB/s) against chunks x 6 steps x 20 us / 2
    # of latency: 16 ms in 268 chunks of 2 MiB, 8 ms in 134 of 4 MiB, 4.0 ms in 67 of 8 MiB (below the transfer);
    # larger chunks only lengthen the pipeline's tail (the intra phases, 3.3 ms / chunks): 8 MiB.
    assert "chunks of 8 MiB" in out
    assert plan_main(argv + ["--chunk-mib", "0.5"]) == 0 and "chunks of 0.5 MiB" in capsys.readouterr().out
    assert plan_main(argv[:-2] + ["--device-memory-gib", "1"]) == 1  # nothing fits 70% of 1 GiB
    assert "choice: none" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--params is required"):
        plan_main([])
    with pytest.raises(SystemExit, match="must divide"):
        plan_main(["--params", "1e9", "--nodes", "3", "--gpus-per-node", "2", "--group-size", "4"])


@pytest.mark.timeout(240)
def test_probe_and_plan_on_four_gloo_processes(tmp_path):
    launch("auto_probe.py", 4, str(tmp_path), "2", timeout=200)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    first = results[0]
    for r in results:  # every rank plans with the same figures, so they agree on the strategy
        assert r["links"] == first["links"] and r["memory"] == first["memory"]
        assert r["choice"] == first["choice"] and r["candidates"] == first["candidates"]
        assert r["measured_choice"] == first["measured_choice"]
        assert r["measured_factor"] == first["measured_factor"]
        assert r["measured_ho_factor"] == first["measured_ho_factor"]
        # the overlap probe's compute is one loop on every rank, sized with every rank computing at once
        assert r["compute_loop"] == first["compute_loop"] >= 1
    for scope in ("intra", "inter"):
        link = first["links"][scope]
        assert 0 < link["bandwidth"] < math.inf and link["latency"] >= 0 and 0 <= link["overlap"] <= 1
    assert first["choice"] in VALID_STRATEGIES and first["measured_choice"] in VALID_STRATEGIES
    assert 0 < first["measured_factor"] < math.inf
    # 2 groups of 2: the probe timed a global (HO-Ring) all-gather against the links' prediction (clamped to 1/4..4)
    factor = first["links"]["hierarchical_factor"]
    assert factor != 1.0 and 0.25 <= factor <= 4.0 and 0.25 <= first["measured_ho_factor"] <= 4.0
    assert 0 < first["memory"] and first["budget"] == pytest.approx(0.7 * first["memory"])
    w = first["workload"]
    assert w["num_units"] == 3 and w["num_trainable"] < w["num_params"] and w["accumulation"] == 4
    notes = "\n".join(first["measured_notes"])
    assert "compute per micro-step not known yet: none assumed" in notes and "links measured" in notes
    assert "AdamW stepped over" in notes  # the update bandwidth timed on the job's optimizer class
    # link cache: the first plan probed and stored (no stored links yet), the second reused those figures after
    # timing the large gathers again, on every rank alike
    assert "no stored links for these hosts and groups; stored for the next job" in notes
    assert first["stored_files"] == 1
    for r in results:
        for field in ("intra", "inter", "reduce_scatter_factor", "hierarchical_factor", "chunk_bytes"):
            assert r["again_cluster"][field] == first["measured_cluster"][field], field
        assert r["again_notes"][0].startswith("links from the link cache, checked: large all-gathers at")
        # the update bandwidth the first job timed was kept with the links and planned with again
        assert r["again_update"] == first["measured_update"] > 0
        assert any("timed by an earlier job and kept with the links" in n for n in r["again_notes"])
    # a first timing of the check far off and a second as stored: reused after the second, the note says so
    for r in results:
        source, note, checks = r["second_chance"]
        assert source == "cache" and checks == 2 and "of the stored times (within 5x, timed twice)" in note, note
    # a stored time ten times what the links now take fails the check: probed again, and the record replaced
    assert first["stale"][0] == "probe" and "failed the check" in first["stale"][1]
    assert all(0 < p < q for p, q in zip(first["rewritten_checks"], first["tampered_checks"]))
    # the check times the probe's large gathers (4 ranks, 2 groups of 2: both links used), at least the pilot's size
    assert all(b >= 2**20 for b in first["links"]["check_bytes"])
    assert all(s > 0 for s in first["links"]["check_seconds"])
    assert first["off"] == ["probe", "links measured by the start-up probe"]
