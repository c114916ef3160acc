"""What a training step holds beyond the model states, in one process: no gradient memory for a unit before its
backward, at most one unit's flattened gradient in flight however slow the reductions, and the gathered parameters
of the root unit and two blocks at most (the one computing and the one prefetched)."""

from __future__ import annotations

import threading
import time

import torch
from tiny_lm import TinyLM

from lightning_paro.strategy.engine import PaROEngine
from lightning_paro.strategy.levels import ShardingSpec


def test_a_step_allocates_gradients_late_and_keeps_one_reduction_in_flight(world_of_one):
    comm = world_of_one
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = PaROEngine(model, ShardingSpec.parse("GGG"), comm, optimizers=[optimizer])

    lock = threading.Lock()
    in_flight, most = 0, 0
    reduce_scatter, submit = comm.reduce_scatter, comm.submit

    def slow_reduce_scatter(out, full, scope, *args, **kwargs):
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        comm.submit(lambda: time.sleep(0.05), what="a slow link", scope=scope)  # far slower than the compute
        return reduce_scatter(out, full, scope, *args, **kwargs)

    def counting_submit(fn, *args, what="", **kwargs):
        if not what.startswith("gradient accumulation"):
            return submit(fn, *args, what=what, **kwargs)

        def accumulate():
            nonlocal in_flight
            fn()
            with lock:
                in_flight -= 1
        return submit(accumulate, *args, what=what, **kwargs)

    comm.reduce_scatter, comm.submit = slow_reduce_scatter, counting_submit
    blocks = [u for u in engine.units if u is not engine.root]
    root = sum(f.full_bytes for f in engine.root.flats)
    block = max(sum(f.full_bytes for f in u.flats) for u in blocks)
    idx = torch.randint(0, 37, (2, 8))
    for micro_step in range(3):
        engine.pre_step()
        engine.gather_meter.reset_peak()
        loss = model(idx).logsumexp(-1).mean()
        for unit in engine.units:  # nothing holds a unit's gradient (the root's included) before its backward
            for f in unit.flats:
                assert all(s.param.grad is None for s in f.slots), (micro_step, unit.name)
        loss.backward()
        engine.finish_backward(sync=micro_step == 2)
        assert engine.gather_meter.peak <= root + 2 * block < engine.full_param_bytes
    optimizer.step()
    engine.after_optimizer_step()
    engine.wait()
    comm.reduce_scatter, comm.submit = reduce_scatter, submit
    trainable_blocks = sum(any(f.trainable for f in u.flats) for u in blocks)
    assert trainable_blocks >= 3 and in_flight == 0
    assert most == 1, f"{most} unit reductions were in flight at once"
