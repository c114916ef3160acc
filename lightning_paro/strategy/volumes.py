"""The PaRO design's volume formulas: traffic per optimizer step and memory per rank, for any strategy.

Figures are per rank and in bytes, for the collectives this engine issues (hierarchical global collectives split
into their intra and inter phases; ring algorithms: an all-gather or reduce-scatter over k ranks sends (k-1)/k of the
full tensor, an all-reduce twice that). Pass padded element counts to match the engine exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_paro.strategy.levels import Level, ShardingSpec


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends per optimizer step."""

    intra: float
    """Over intra-group links."""
    inter: float
    """Over inter-group links."""


def _ag(level: Level, S: float, m: int, g: int) -> Traffic:
    """All-gather of a buffer of S bytes from level ``level`` shards."""
    if level == Level.N:
        return Traffic(0, 0)
    if level == Level.I:
        return Traffic((m - 1) / m * S, 0)
    return Traffic((m - 1) / m * S, (g - 1) / g * S / m)


def _add(*ts: Traffic) -> Traffic:
    return Traffic(sum(t.intra for t in ts), sum(t.inter for t in ts))


def _scale(t: Traffic, k: float) -> Traffic:
    return Traffic(t.intra * k, t.inter * k)


def step_traffic(spec: ShardingSpec, params_bytes: float, trainable_bytes: float, m: int, g: int,
                 accumulation: int, gathers: int = 2) -> Traffic:
    """Traffic per optimizer step of ``spec`` (hierarchical collectives, split by scope).

    Args:
        params_bytes: b_p * Psi (all parameters, padded).
        trainable_bytes: b_g * Psi' (trainable parameters, padded; the parameters are assumed to have the same
            dtype as their gradients).
        m, g: ranks per group and number of groups.
        accumulation: A, micro-steps per optimizer step.
        gathers: parameter gathers per micro-step: 2 for a unit (before forward and before backward), 1 for the
            root unit, which stays gathered from the start of the forward to the end of the backward.
    """
    return _step(spec, params_bytes, trainable_bytes, m, g, accumulation, gathers,
                 lambda level, S: _ag(level, S, m, g))


def flat_step_traffic(spec: ShardingSpec, params_bytes: float, trainable_bytes: float, m: int, n: int,
                      accumulation: int) -> Traffic:
    """The PaRO paper's accounting: every global collective counted as inter-group traffic of a flat ring."""
    def vol(level: Level, S: float) -> Traffic:
        if level == Level.I:
            return Traffic((m - 1) / m * S, 0)
        if level == Level.G:
            return Traffic(0, (n - 1) / n * S)
        return Traffic(0, 0)

    return _step(spec, params_bytes, trainable_bytes, m, n // m, accumulation, 2, vol)


def _step(spec: ShardingSpec, S: float, T: float, m: int, g: int, accumulation: int, gathers: int,
          vol) -> Traffic:
    """The volumes of paro.md section 4; ``vol(level, S)`` is what an all-gather (or reduce-scatter) of S bytes
    from level-``level`` shards sends, which is where the two accountings differ."""
    P, G, OS = spec.params, spec.grads, spec.optim
    # Per micro-step: gather P before forward (and before backward); reduce-scatter G after backward.
    micro = _add(_scale(vol(P, S), gathers), vol(G, T))
    rail = (g - 1) / g * T / m  # one reduce-scatter or all-gather of a 1/m slice over the rail
    # Once per step: gradient sync G -> OS.
    if G == Level.N:
        syncg = {Level.N: _scale(vol(Level.G, T), 2),  # all-reduce = reduce-scatter + all-gather
                 Level.I: _add(vol(Level.I, T), Traffic(0, 2 * rail)),
                 Level.G: vol(Level.G, T)}[OS]
    elif G == Level.I:
        syncg = Traffic(0, (2 if OS == Level.I else 1) * rail)
    else:
        syncg = Traffic(0, 0)
    # Parameter sync OS -> P (trainable parameters only: frozen ones never change).
    if OS == P:
        syncp = Traffic(0, 0)
    elif P == Level.N:
        syncp = vol(OS, T)
    else:  # G -> I
        syncp = Traffic(0, rail)
    return _add(_scale(micro, accumulation), syncg, syncp)


def model_state_bytes(spec: ShardingSpec, num_params: float, num_trainable: float, m: int, n: int,
                      param_bytes: int = 4, grad_bytes: int = 4, optim_bytes: int = 8) -> dict[str, float]:
    """Per-rank model-state memory, section 5: ``b_p Psi / d(P) + b_g Psi' / d(G) + K Psi' / d(OS)``."""
    d = lambda level: level.degree(m, n)  # noqa: E731
    return {
        "params": param_bytes * num_params / d(spec.params),
        "grads": grad_bytes * num_trainable / d(spec.grads),
        "optim": optim_bytes * num_trainable / d(spec.optim),
    }
