"""HO-Ring pieces that need no process group: the layout, its chunking, configuration checks."""

from __future__ import annotations

import pytest

from lightning_paro.comm import ho_ring
from lightning_paro.comm.ho_ring import layout
from lightning_paro.comm.topology import Topology


@pytest.mark.parametrize("numel", [0, 1, 5, 13, 64, 1001])
@pytest.mark.parametrize("m,g", [(1, 4), (2, 2), (4, 1), (2, 4), (4, 2)])
def test_shards_tile_the_buffer_in_layout_order(numel: int, m: int, g: int) -> None:
    n = m * g
    shards = [ho_ring.shard_range(numel, Topology(n, m, r)) for r in range(n)]
    # Rank (i, j) owns global shard j * g + i: ordering shards that way must tile [0, numel) with no gap or overlap.
    by_global_index = sorted(range(n), key=lambda r: (r % m) * g + r // m)
    pos = 0
    for r in by_global_index:
        a, b = shards[r]
        assert a == pos and b >= a
        pos = b
    assert pos == numel
    sizes = [b - a for a, b in shards]
    assert max(sizes) - min(sizes) <= (1 if numel else 0) + (1 if m > 1 and g > 1 else 0)


def test_layout_matches_paro_when_n_divides() -> None:
    # 16 elements, m = 2 blocks of 8, g = 4 sub-blocks of 2: rank (i=1, j=1) = rank 3 owns block 1, sub-block 1.
    assert ho_ring.shard_range(16, Topology(8, 2, 3)) == (10, 12)
    assert ho_ring.layout_ranges(0, 16, 2, 4)[0] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("numel,piece", [(1, 1), (37, 4), (1000, 7), (13, 100)])
def test_layout_chunks_cover_every_sub_block_once(numel: int, piece: int) -> None:
    m, g = 2, 3
    chunks = layout._layout_chunks(numel, piece, m, g)
    full = ho_ring.layout_ranges(0, numel, m, g)
    for j in range(m):
        for i in range(g):
            covered = [c[j][i] for c in chunks if c[j][i][1] > c[j][i][0]]
            if full[j][i][1] == full[j][i][0]:
                assert not covered
                continue
            assert covered[0][0] == full[j][i][0] and covered[-1][1] == full[j][i][1]
            assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
            assert all(b - a <= piece for a, b in covered)


def test_contiguous_chunks_cover_the_buffer() -> None:
    chunks = layout._contiguous_chunks(1003, 100, 2, 2)
    assert len(chunks) == 11
    assert chunks[0][0][0][0] == 0 and chunks[-1][-1][-1][1] == 1003


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        ho_ring.HORingConfig(chunk_bytes=0)
    with pytest.raises(ValueError, match="flat_below_bytes"):
        ho_ring.HORingConfig(flat_below_bytes=-1)


def test_rank_order_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match="permutation"):
        ho_ring.HORingGroups(Topology(4, 2, 0), [0, 1, 1, 3])
