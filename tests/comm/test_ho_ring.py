"""HO-Ring collectives against the flat torch.distributed collectives, on gloo, in real multi-process worlds.

One launch per world size runs every check (worker: ``workers/ho_ring_checks.py``) and reports one line per case;
the tests below assert on those lines. World 4 covers the 2x2 layout and the degenerate group sizes 1 and n; world 8
covers 4x2, 2x4 and 4x2 with ranks placed round-robin over nodes.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from launch import launch

WORKER = str(Path(__file__).parent / "workers" / "ho_ring_checks.py")
WORLDS = {4: ("2,1,4",), 8: ("2,4", "2")}
LAYOUT_WORLD = {"2x2": 4, "4x1": 4, "1x4": 4, "4x2": 8, "2x4": 8, "4x2-round-robin": 8}
# Per rank and (collective, mode, layout): 2 dtypes x 2 ops x (4 sizes pipelined + 2 sizes with the defaults, which
# run flat); async runs the pipelined ones only.
CASES_PER_GROUP = {"sync": 2 * 2 * (4 + 2), "async": 2 * 2 * 4}


@lru_cache(maxsize=None)
def results(world: int) -> dict[str, list[str]]:
    """Launch the world once; map each case name to the failure reasons of every rank ("" = passed)."""
    outputs = launch(WORKER, world, *WORLDS[world], timeout=150)
    out: dict[str, list[str]] = {}
    for rank, text in enumerate(outputs):
        assert text.rstrip().endswith("DONE"), f"rank {rank} did not finish:\n{text[-3000:]}"
        for line in text.splitlines():
            if line.startswith("RESULT "):
                _, name, verdict = line.split(" ", 2)
                out.setdefault(name, []).append("" if verdict == "OK" else f"rank {rank}: {verdict}")
    return out


def cases(world: int, prefix: str) -> dict[str, list[str]]:
    """Cases whose name starts with ``prefix`` (a name ending in "/") or equals it."""
    return {k: v for k, v in results(world).items() if (k.startswith(prefix) if prefix.endswith("/") else k == prefix)}


def assert_all_passed(found: dict[str, list[str]], world: int, expected_cases: int) -> None:
    assert len(found) == expected_cases, f"expected {expected_cases} cases, got {len(found)}: {sorted(found)[:5]}"
    failures = {name: [r for r in reasons if r] for name, reasons in found.items()}
    failures = {name: reasons for name, reasons in failures.items() if reasons}
    assert not failures, "\n".join(f"{name}: {reasons}" for name, reasons in sorted(failures.items())[:20])
    assert all(len(reasons) == world for reasons in found.values()), "some rank did not report every case"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("layout", list(LAYOUT_WORLD))
def test_matches_flat_collective(layout: str, collective: str, mode: str) -> None:
    """Sum and avg, fp32 and bf16, sizes not divisible by n, pipelined and default configuration: equal to flat."""
    world = LAYOUT_WORLD[layout]
    assert_all_passed(cases(world, f"{collective}/{mode}/{layout}/"), world, CASES_PER_GROUP[mode])


@pytest.mark.parametrize("layout", list(LAYOUT_WORLD))
def test_all_reduce_gives_every_rank_the_same_bits(layout: str) -> None:
    world = LAYOUT_WORLD[layout]
    assert_all_passed(cases(world, f"all_reduce/identical_bits/{layout}"), world, 1)
    assert_all_passed(cases(world, f"all_reduce/close_to_flat/{layout}"), world, 1)


@pytest.mark.parametrize("layout", list(LAYOUT_WORLD))
def test_traffic_is_recorded_by_scope_at_ideal_volume(layout: str) -> None:
    """Degenerate layouts record no intra (m = 1) or no inter (m = n) traffic, like a flat collective over one scope."""
    world = LAYOUT_WORLD[layout]
    assert_all_passed(cases(world, f"traffic/all_reduce/{layout}"), world, 1)
    assert_all_passed(cases(world, f"traffic/reduce_scatter_all_gather/{layout}"), world, 1)


RAIL_LAYOUTS = [layout for layout in LAYOUT_WORLD if not layout.startswith("1x")]
# Per rank and (collective, mode, layout): 2 chunk sizes x 2 dtypes x 2 ops x 3 sizes.
RAIL_CASES = 2 * 2 * 2 * 3


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("layout", RAIL_LAYOUTS)
def test_rail_collectives_match_the_flat_collective_over_the_rail(layout: str, collective: str, mode: str) -> None:
    """Inter-only collectives (PaRO's level-I blocks) through HO-Ring's point-to-point inter phase: equal to the sum
    over the ranks with the same local index, for sizes below g and not divisible by g, one and many chunks."""
    world = LAYOUT_WORLD[layout]
    assert_all_passed(cases(world, f"rail_{collective}/{mode}/{layout}/"), world, RAIL_CASES)


@pytest.mark.parametrize("layout", list(LAYOUT_WORLD))
def test_single_thread_mode_gives_the_same_bits_from_the_calling_thread(layout: str) -> None:
    """Every global and rail collective in single-thread mode equals the phase threads' result bit for bit (rings
    over 4 groups included), and every message was posted from the calling thread through batch_isend_irecv."""
    world = LAYOUT_WORLD[layout]
    rails = 3 if not layout.startswith("1x") else 0
    assert_all_passed(cases(world, f"single_thread/{layout}/"), world, 3 + rails + 1)


def test_groups_of_a_layout_are_created_once_per_process() -> None:
    assert_all_passed(cases(4, "shared_groups"), 4, 1)
    assert_all_passed(cases(8, "shared_groups"), 8, 1)


def test_rank_order_by_node_groups_round_robin_ranks() -> None:
    assert_all_passed(cases(8, "rank_order_by_node"), 8, 1)
