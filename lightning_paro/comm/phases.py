"""One phase of a collective: the step over the ranks of one group or one rail that a Communicator's collectives are
made of.

A global collective is a phase inside the rank's group and a hop between groups over its rail (section 4 of the PaRO
design); an intra or inter collective is one phase. Every phase offers the same three operations and says how many
bytes a rank sends in each, so each collective is written once, whatever its hop between groups does:

* :class:`ExactPhase` sends the values as they are: inside the group over the intra group, in pieces where the
  backend stages a whole copy (:mod:`lightning_paro.comm.pieces`); between groups as HO-Ring's rail exchange when the
  communicator has its groups, else over the rail group.
* :class:`QuantizedHop` is the hop between groups sent block-quantized (``inter_quant="int8"``,
  :mod:`lightning_paro.comm.quantize`), with error feedback when a buffer for it is given; it sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_paro.comm import ho_ring, pieces, quantize
from lightning_paro.comm.accounting import INTER, ring_bytes
from lightning_paro.comm.ho_ring import HORingGroups


@dataclass(frozen=True)
class ExactPhase:
    """A phase that sends the values as they are, over ``ranks`` ranks."""

    scope: str
    """``intra`` or ``inter``: where the traffic is recorded."""
    ranks: int
    """Ranks taking part (the group size m, or the number of groups g)."""
    group: Any
    """Their process group (None when ``ranks`` is 1)."""
    piece_bytes: int
    """Largest piece of an all-gather or reduce-scatter on a backend that stages the whole buffer (gloo)."""
    rail: HORingGroups | None = None
    """Between groups: HO-Ring's groups, whose rail exchange sends the ideal volume point to point."""
    chunk_bytes: int = ho_ring.DEFAULT_CONFIG.chunk_bytes
    """HO-Ring's chunk size (with ``rail``)."""
    single_thread: bool | None = None
    """HO-Ring's thread mode (with ``rail``; :attr:`~lightning_paro.comm.ho_ring.HORingConfig.single_thread`)."""

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out``: every rank's ``shard`` in rank order (``shard`` may be this rank's slot of ``out``)."""
        self._between(out, shard, ho_ring.rail_all_gather, pieces.all_gather)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, error: torch.Tensor | None = None) -> None:
        """``out``: this rank's slice of ``full`` summed over the ranks. Nothing is left out, so ``error`` is not
        used."""
        self._between(out, full, ho_ring.rail_reduce_scatter, pieces.reduce_scatter)

    def all_reduce(self, tensor: torch.Tensor, error: torch.Tensor | None = None) -> None:
        """``tensor`` summed over the ranks, in place; ``error`` is not used."""
        if self.ranks == 1:
            return
        if self.rail is not None:
            ho_ring.rail_all_reduce(tensor, self.rail, **self._rail_kwargs())
        else:
            dist.all_reduce(tensor, group=self.group)

    def sent(self, op: str, numel: int, nbytes: int) -> int:
        """Bytes this rank sends in ``op`` over a full buffer of ``numel`` elements and ``nbytes`` bytes: a ring's."""
        return ring_bytes(op, nbytes, self.ranks)

    def _between(self, out: torch.Tensor, src: torch.Tensor, on_rail: Callable, in_pieces: Callable) -> None:
        """An all-gather or reduce-scatter from ``src`` into ``out``: a copy over one rank, else on the rail or in
        pieces."""
        if self.ranks == 1:
            if src.data_ptr() != out.data_ptr():
                out.copy_(src)
        elif self.rail is not None:
            on_rail(out, src, self.rail, **self._rail_kwargs())
        else:
            in_pieces(out, src, self.group, self.ranks, self.piece_bytes)

    def _rail_kwargs(self) -> dict:
        return {"chunk_bytes": self.chunk_bytes, "single_thread": self.single_thread}


@dataclass(frozen=True)
class QuantizedHop:
    """The hop between groups with every contribution sent block-quantized once (:mod:`lightning_paro.comm.quantize`):
    one payload of each slice to each of the other groups."""

    ranks: int
    """The number of groups g (at least 2)."""
    group: Any
    """The rank's rail group."""
    index: int
    """This rank's group: the slice it owns."""

    scope = INTER

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out``: every rank's quantized ``shard``, dequantized (this rank's too, so every rank holds the same)."""
        quantize.all_gather(out, shard, self.group, self.ranks)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, error: torch.Tensor | None = None) -> None:
        """``out``: this rank's slice of ``full`` summed over the ranks, the peers' slices quantized; ``error``:
        error feedback for the slices this rank sends (fp32, ``full``'s size)."""
        quantize.reduce_scatter(out, full, self.group, self.ranks, self.index, error)

    def all_reduce(self, tensor: torch.Tensor, error: torch.Tensor | None = None) -> None:
        """``tensor`` summed over the ranks, in place: a quantized reduce-scatter (with ``error`` feedback), then a
        quantized all-gather."""
        quantize.all_reduce(tensor, self.group, self.ranks, self.index, error)

    def sent(self, op: str, numel: int, nbytes: int) -> int:
        """Bytes this rank sends in ``op`` over a full buffer of ``numel`` elements: a payload of each 1/g slice to
        each other group, twice for an all-reduce (its reduce-scatter and its all-gather)."""
        rounds = 2 if op == "all_reduce" else 1
        return rounds * (self.ranks - 1) * quantize.payload_bytes(numel // self.ranks)
