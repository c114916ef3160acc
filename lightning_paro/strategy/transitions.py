"""The level transitions of PaRO-DP: which collectives move a buffer from one level to another.

This is the one place that says it. The engine issues exactly these collectives (``flat.py``), the design's volume
formulas are summed from them (``volumes.py``) and the cost model times them (``lightning_paro.planner.phases``). A
transition is a short sequence of :class:`Collective`\\ s; four kinds of buffer change level:

* :func:`gather_params`: the P-level shards of a unit's parameters into the full buffer, before its use;
* :func:`reduce_grads`: a unit's full local gradient into the G-level accumulator, after its backward;
* :func:`grads_to_optim`: the accumulated gradient from level G to level OS, once per optimizer step;
* :func:`optim_to_params`: the updated OS-level shard to level P, once per optimizer step.

Shards are laid out so that every collective is contiguous and I -> G is a view (design, section 3): rank (i, j)
holds intra block j at level I and sub-block i of it at level G, so a G-level shard is an I-level block reduced or
gathered over the rail (``inter``) and a global collective is an intra one and a rail one (``link_phases``).

Each collective also says the dtype it travels in (:class:`CommDtypes`, ``PaROStrategy(param_dtype=...,
reduce_dtype=...)``): parameters in ``param_dtype``, gradients in ``reduce_dtype``, the buffer's own dtype where
unset; and a collective that crosses groups (scope ``inter`` or ``global``) whether its hop between groups is
block-quantized (``inter_quant``, ``lightning_paro.comm.quantize``). So its bytes on the wire (:func:`wire_bytes`,
:func:`phase_wire_bytes`) are stated here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_paro.comm.quantize import payload_bytes
from lightning_paro.strategy.levels import Level, ShardingSpec

Op = Literal["all_gather", "reduce_scatter", "all_reduce"]
Scope = Literal["intra", "inter", "global"]
Link = Literal["intra", "inter"]

SCOPE_OF: dict[Level, Scope] = {Level.I: "intra", Level.G: "global"}
"""The ranks over which a buffer at this level is sharded."""


@dataclass(frozen=True)
class Collective:
    """One collective of a transition."""

    op: Op
    """all_gather, reduce_scatter or all_reduce."""
    scope: Scope
    """The ranks it runs over: the rank's group (intra), its rail across groups (inter), or all ranks (global)."""
    full: Level
    """The level of its full side (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer): N for
    the whole buffer, I for one intra block (1/m of it)."""
    dtype: torch.dtype | None = None
    """The dtype it travels (and, for a reduction, sums) in; None: the buffer's own."""
    quant: str | None = None
    """Its phase between groups sent block-quantized ("int8", ``comm.quantize``) instead of in ``dtype``; None: not.
    A quantized global collective runs its phases one after the other (not pipelined as an HO-Ring)."""

    def full_fraction(self, group_size: int) -> float:
        """The full side's share of the whole buffer."""
        return 1.0 if self.full == Level.N else 1.0 / group_size

    def wire_dtype(self, buffer_dtype: torch.dtype) -> torch.dtype:
        """The dtype it travels in for a buffer of ``buffer_dtype``."""
        return buffer_dtype if self.dtype is None else self.dtype


@dataclass(frozen=True)
class CommDtypes:
    """The dtypes parameters and gradients travel in (FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``);
    the optimizer shard, the gradient accumulators and the parameters' own storage keep their dtypes."""

    params: torch.dtype | None = None
    """Parameter all-gathers (before a unit's use, and OS -> P after the update); None: the parameters' dtype."""
    grads: torch.dtype | None = None
    """Gradient reductions (after a unit's backward, and G -> OS at the boundary); None: the gradients' dtype."""
    inter_quant: str | None = None
    """"int8": every collective's hop between groups goes block-quantized, one quantization per contribution; the
    phases inside groups keep the dtypes above. None: everything in the dtypes above."""
    error_feedback: bool = False
    """With ``inter_quant``: each rank carries what quantizing its gradients left out into its next reduction (the
    bytes sent do not change)."""


EXACT = CommDtypes()
"""Every buffer travels in its own dtype: the default, bit for bit what the engine holds."""


def wire_bytes(c: Collective, nbytes: float, element_bytes: int) -> float:
    """Bytes of ``c``'s full side on the wire, for a buffer whose full side holds ``nbytes`` in its own elements of
    ``element_bytes`` each (its dtype; a quantized collective: :func:`phase_wire_bytes`)."""
    if c.dtype is None:
        return nbytes
    return nbytes * dtype_bytes(c.dtype) / element_bytes


def phase_wire_bytes(c: Collective, p: LinkPhase, nbytes: float, element_bytes: int, ranks: int) -> float:
    """Bytes of phase ``p``'s full side on the wire, over ``ranks`` ranks: ``ranks`` quantized payloads of one slice
    each for a quantized rail collective, the share of :func:`wire_bytes` otherwise (so that a ring phase sends
    (k - 1)/k of it, twice for an all-reduce)."""
    if c.quant is not None and p.link == "inter":
        return ranks * payload_bytes(round(p.fraction * nbytes / element_bytes / ranks))
    return p.fraction * wire_bytes(c, nbytes, element_bytes)


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def rounds(c: Collective, buffer_dtype: torch.dtype) -> bool:
    """Whether a buffer of ``buffer_dtype`` may arrive changed through ``c`` (quantized, or in fewer bits)."""
    return c.quant is not None or lossy(c.wire_dtype(buffer_dtype), buffer_dtype)


def param_sync_rounds(spec: ShardingSpec, comm: CommDtypes, dtype: torch.dtype) -> bool:
    """Whether the OS -> P sync of parameters stored in ``dtype`` rounds what it writes (they travel in fewer bits,
    or quantized): the optimizer's master copy must then be kept apart from the P-level storage."""
    return any(rounds(c, dtype) for c in optim_to_params(spec.optim, spec.params, comm))


def keeps_error_feedback(spec: ShardingSpec, comm: CommDtypes, num_groups: int) -> bool:
    """Whether a trainable buffer keeps an error-feedback buffer: asked for, and a gradient sync quantizes a hop
    between groups (there are several)."""
    syncs = (*reduce_grads(spec.grads, comm), *grads_to_optim(spec.grads, spec.optim, comm))
    return comm.error_feedback and num_groups > 1 and any(c.quant for c in syncs)


def lossy(wire: torch.dtype, buffer_dtype: torch.dtype) -> bool:
    """Whether a buffer of ``buffer_dtype`` sent as ``wire`` may arrive changed (rounded to fewer bits)."""
    if wire == buffer_dtype:
        return False
    if not (wire.is_floating_point and buffer_dtype.is_floating_point):
        return True
    return torch.finfo(wire).bits <= torch.finfo(buffer_dtype).bits


@dataclass(frozen=True)
class LinkPhase:
    """One phase of a collective over one link class (a global collective has two or three)."""

    op: Op
    link: Link
    fraction: float
    """The phase's full side as a share of the whole buffer."""


Transition = tuple[Collective, ...]


def _collective(op: Op, scope: Scope, full: Level, dtype: torch.dtype | None, comm: CommDtypes) -> Collective:
    """A collective of the table, quantized between groups when it crosses them and ``comm`` asks for it."""
    return Collective(op, scope, full, dtype, comm.inter_quant if scope != "intra" else None)


def gather_params(params: Level, comm: CommDtypes = EXACT) -> Transition:
    """P-level shards -> the full parameters (before a unit's forward, and its backward)."""
    return () if params == Level.N else (_collective("all_gather", SCOPE_OF[params], Level.N, comm.params, comm),)


def reduce_grads(grads: Level, comm: CommDtypes = EXACT) -> Transition:
    """A unit's full local gradient -> its G-level accumulator (after the unit's backward; nothing at G = N, where
    autograd accumulates into the full gradient)."""
    return () if grads == Level.N else (_collective("reduce_scatter", SCOPE_OF[grads], Level.N, comm.grads, comm),)


def grads_to_optim(grads: Level, optim: Level, comm: CommDtypes = EXACT) -> Transition:
    """The accumulated gradient at level G -> level OS, summed over every rank (once per optimizer step)."""
    d = comm.grads
    if grads == Level.N:
        if optim == Level.N:
            return (_collective("all_reduce", "global", Level.N, d, comm),)
        if optim == Level.I:
            return (Collective("reduce_scatter", "intra", Level.N, d),
                    Collective("all_reduce", "inter", Level.I, d, comm.inter_quant))
        return (_collective("reduce_scatter", "global", Level.N, d, comm),)
    if grads == Level.I:
        # the group has reduced its own contributions: the rail adds the other groups'
        if optim == Level.I:
            return (Collective("all_reduce", "inter", Level.I, d, comm.inter_quant),)
        return (Collective("reduce_scatter", "inter", Level.I, d, comm.inter_quant),)
    return ()  # G = G: the reduce-scatter of every micro-step summed over all ranks already


def optim_to_params(optim: Level, params: Level, comm: CommDtypes = EXACT) -> Transition:
    """The updated OS-level shard -> the P-level parameters (once per optimizer step, after the update)."""
    if params == optim:
        return ()
    if params == Level.N:
        return (_collective("all_gather", SCOPE_OF[optim], Level.N, comm.params, comm),)
    # G -> I: the sub-blocks of this rank's block, over its rail
    return (Collective("all_gather", "inter", Level.I, comm.params, comm.inter_quant),)


def step_transitions(spec: ShardingSpec, comm: CommDtypes = EXACT) -> dict[str, Transition]:
    """Every transition of ``spec`` by name: what a strategy is, as traffic."""
    return {"gather_params": gather_params(spec.params, comm), "reduce_grads": reduce_grads(spec.grads, comm),
            "grads_to_optim": grads_to_optim(spec.grads, spec.optim, comm),
            "optim_to_params": optim_to_params(spec.optim, spec.params, comm)}


def link_phases(c: Collective, group_size: int, num_groups: int) -> tuple[LinkPhase, ...]:
    """``c`` as phases over one link class each, the way the communicator runs it: a global all-gather is a rail
    all-gather of this rank's intra block then an intra all-gather, a global reduce-scatter the reverse, a global
    all-reduce an intra reduce-scatter, a rail all-reduce of the block and an intra all-gather. Phases over one rank
    (m = 1 or g = 1) move nothing and are left out."""
    f, m = c.full_fraction(group_size), group_size
    if c.scope != "global":
        phases = (LinkPhase(c.op, c.scope, f),)
    elif c.op == "all_gather":
        phases = (LinkPhase("all_gather", "inter", f / m), LinkPhase("all_gather", "intra", f))
    elif c.op == "reduce_scatter":
        phases = (LinkPhase("reduce_scatter", "intra", f), LinkPhase("reduce_scatter", "inter", f / m))
    else:
        phases = (LinkPhase("reduce_scatter", "intra", f), LinkPhase("all_reduce", "inter", f / m),
                  LinkPhase("all_gather", "intra", f))
    ranks = {"intra": group_size, "inter": num_groups}
    return tuple(p for p in phases if ranks[p.link] > 1)
