"""The PaRO design's volume formulas: traffic per optimizer step and memory per rank, for any strategy.

Figures are per rank and in bytes, summed over the collectives of the strategy's level transitions
(``transitions.py``), as this engine issues them (hierarchical global collectives split into their intra and inter
phases; ring algorithms: an all-gather or reduce-scatter over k ranks sends (k-1)/k of the full tensor, an all-reduce
twice that). Pass padded element counts to match the engine exactly. A collective that travels in another dtype than
the buffer's (``CommDtypes``: ``param_dtype``, ``reduce_dtype``) counts the bytes of that dtype; a quantized rail
collective (``inter_quant``) its payloads.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_paro.strategy.levels import ShardingSpec
from lightning_paro.strategy.transitions import (
    EXACT,
    CommDtypes,
    Transition,
    link_phases,
    phase_wire_bytes,
    step_transitions,
    wire_bytes,
)


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends per optimizer step."""

    intra: float
    """Over intra-group links."""
    inter: float
    """Over inter-group links."""


def _add(*ts: Traffic) -> Traffic:
    return Traffic(sum(t.intra for t in ts), sum(t.inter for t in ts))


def _scale(t: Traffic, k: float) -> Traffic:
    return Traffic(t.intra * k, t.inter * k)


def _ring(op: str, ranks: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring collective over ``ranks`` ranks whose full side is ``nbytes``."""
    return (2 if op == "all_reduce" else 1) * (ranks - 1) / ranks * nbytes


def transition_traffic(transition: Transition, nbytes: float, m: int, g: int, element_bytes: int = 4) -> Traffic:
    """What one rank sends for ``transition`` on a buffer of ``nbytes`` (elements of ``element_bytes``): each
    collective split into its link phases, as the communicator runs it, in the dtype it travels in."""
    out = Traffic(0, 0)
    for c in transition:
        for p in link_phases(c, m, g):
            k = m if p.link == "intra" else g
            sent = _ring(p.op, k, phase_wire_bytes(c, p, nbytes, element_bytes, k))
            out = _add(out, Traffic(sent, 0) if p.link == "intra" else Traffic(0, sent))
    return out


def step_traffic(spec: ShardingSpec, params_bytes: float, trainable_bytes: float, m: int, g: int,
                 accumulation: int, gathers: int = 2, comm: CommDtypes = EXACT, element_bytes: int = 4) -> Traffic:
    """Traffic per optimizer step of ``spec`` (hierarchical collectives, split by scope).

    Args:
        params_bytes: b_p * Psi (all parameters, padded).
        trainable_bytes: b_g * Psi' (trainable parameters, padded; the parameters are assumed to have the same
            dtype as their gradients).
        m, g: ranks per group and number of groups.
        accumulation: A, micro-steps per optimizer step.
        gathers: parameter gathers per micro-step: 2 for a unit (before forward and before backward), 1 for the
            root unit, which stays gathered from the start of the forward to the end of the backward.
        comm: the dtypes parameters and gradients travel in (default: their own).
        element_bytes: b_p = b_g, bytes per parameter and gradient element (only read when ``comm`` sets a dtype).
    """
    return _step(spec, params_bytes, trainable_bytes, accumulation, gathers,
                 lambda t, nbytes: transition_traffic(t, nbytes, m, g, element_bytes), comm)


def flat_step_traffic(spec: ShardingSpec, params_bytes: float, trainable_bytes: float, m: int, n: int,
                      accumulation: int, comm: CommDtypes = EXACT, element_bytes: int = 4) -> Traffic:
    """The PaRO paper's accounting: every global collective counted as inter-group traffic of a flat ring."""
    g = n // m

    def flat(transition: Transition, nbytes: float) -> Traffic:
        out = Traffic(0, 0)
        for c in transition:
            if c.scope == "global":
                out = _add(out, Traffic(0, _ring(c.op, n, c.full_fraction(m) * wire_bytes(c, nbytes, element_bytes))))
            else:
                out = _add(out, transition_traffic((c,), nbytes, m, g, element_bytes))
        return out

    return _step(spec, params_bytes, trainable_bytes, accumulation, 2, flat, comm)


def _step(spec: ShardingSpec, S: float, T: float, accumulation: int, gathers: int, traffic_of,
          comm: CommDtypes) -> Traffic:
    """The volumes of paro.md section 4, summed over the strategy's transitions; ``traffic_of(transition, nbytes)``
    is what a transition of a buffer of that size sends, which is where the two accountings differ. Per micro-step the
    parameters are gathered ``gathers`` times and the gradient reduced once; per optimizer step the gradient goes
    G -> OS and the trainable parameters (frozen ones never change) OS -> P."""
    t = step_transitions(spec, comm)
    micro = _add(_scale(traffic_of(t["gather_params"], S), gathers), traffic_of(t["reduce_grads"], T))
    return _add(_scale(micro, accumulation), traffic_of(t["grads_to_optim"], T), traffic_of(t["optim_to_params"], T))


def model_state_bytes(spec: ShardingSpec, num_params: float, num_trainable: float, m: int, n: int,
                      param_bytes: int = 4, grad_bytes: int = 4, optim_bytes: int = 8) -> dict[str, float]:
    """Per-rank model-state memory, section 5: ``b_p Psi / d(P) + b_g Psi' / d(G) + K Psi' / d(OS)``."""
    d = lambda level: level.degree(m, n)  # noqa: E731
    return {
        "params": param_bytes * num_params / d(spec.params),
        "grads": grad_bytes * num_trainable / d(spec.grads),
        "optim": optim_bytes * num_trainable / d(spec.optim),
    }
