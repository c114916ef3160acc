import pytest
from torch import nn

from lightning_paro.comm.topology import Topology
from lightning_paro.strategy.layout import ShardLayout
from lightning_paro.strategy.levels import VALID_STRATEGIES, Level, ShardingSpec
from lightning_paro.strategy.units import find_units


def test_fourteen_valid_strategies():
    assert len(VALID_STRATEGIES) == 14
    assert set(VALID_STRATEGIES) >= {"NNN", "NNG", "NGG", "GGG", "III", "NII", "NIG", "ING", "IIG", "IGG"}
    for name in VALID_STRATEGIES:
        assert ShardingSpec.parse(name.lower()).name == name


@pytest.mark.parametrize("bad", ["NGN", "GNN", "IGI", "XYZ", "NN", "nigg", "", 3])
def test_invalid_strategy_lists_the_valid_ones(bad):
    with pytest.raises(ValueError) as err:
        ShardingSpec.parse(bad)
    for name in VALID_STRATEGIES:
        assert name in str(err.value)


@pytest.mark.parametrize("n,m", [(4, 2), (8, 2), (8, 4), (6, 3), (4, 1), (4, 4)])
def test_layout_levels_nest_and_tile(n, m):
    numel = 37
    layouts = [ShardLayout.of(numel, Topology(n, m, r)) for r in range(n)]
    padded = layouts[0].padded
    assert padded % n == 0 and padded >= numel
    for level in Level:
        cover = sorted(lay.range(level) for lay in layouts)
        if level == Level.G:  # the n global shards tile the buffer exactly
            assert [a for a, _ in cover] == list(range(0, padded, padded // n))
    for lay in layouts:
        g0, g1 = lay.range(Level.G)
        i0, i1 = lay.range(Level.I)
        assert i0 <= g0 < g1 <= i1  # I -> G is a view
        # global shard index j*g + i: the rail's ranks hold consecutive sub-blocks of one intra block
        assert g0 == (lay.local_index * (n // m) + lay.group_index) * (padded // n)


def test_group_size_must_divide_world():
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        Topology(6, 4, 0)


def test_topology_groups_and_rails():
    t = Topology(8, 2, 5)
    assert (t.num_groups, t.group_index, t.local_index) == (4, 2, 1)
    assert t.intra_ranks() == [4, 5]
    assert t.rail_ranks() == [1, 3, 5, 7]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Sequential(nn.Linear(3, 3), nn.ReLU())


def test_auto_units_are_the_repeated_blocks():
    net = Net()
    assert [n for n, _ in find_units(net)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in find_units(net, [nn.Linear])][:2] == ["blocks.0.a", "blocks.0.b"]
    assert [n for n, _ in find_units(net, lambda name, m: name == "head")] == ["head"]
    assert find_units(nn.Linear(2, 2)) == []
    with pytest.raises(ValueError, match="Unknown unit policy"):
        find_units(net, "blocks")
