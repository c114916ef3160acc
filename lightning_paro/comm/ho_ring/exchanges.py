"""HO-Ring's exchanges: the point-to-point messages of one chunk in one phase, and the stages built from them.

Every phase is built from point-to-point sends of views of the caller's buffers: each rank sends every peer exactly
the slice that peer owns and sums what it receives (a one-step all-to-all), or, over more than two groups, passes
partial sums around a ring (one peer each way at a time: k - 1 streams on one link share it less well than one does).
Both move the ideal volume, ``(k-1)/k`` of the data per reduce-scatter or all-gather over k ranks, with no staging
copies; gloo's own ``reduce_scatter`` moves twice that. Each element of a reduction is summed by exactly one rank and
then copied to the others, so every rank ends with the same bits.

An exchange posts its messages on a :class:`~lightning_paro.comm.ho_ring.pipeline._Lane` and returns the function
that waits for them (and sums); :func:`_scatter_stage` and :func:`_gather_stage` make pipeline stages of them.
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_paro.comm.ho_ring.layout import Range, _size
from lightning_paro.comm.ho_ring.pipeline import Stage, _Lane, _then


def _view(buf: torch.Tensor, offset: int, r: Range) -> torch.Tensor:
    """Elements ``r`` of a full buffer, stored in ``buf`` starting at full-buffer index ``offset``."""
    return buf[r[0] - offset:r[1] - offset]


def _reduce_exchange(lane: _Lane, peers: list[int], me: int, send_ranges: list[list[Range]],
                     src: torch.Tensor, src_off: int, dst: torch.Tensor, dst_off: int) -> Callable[[], None]:
    """Reduce-scatter by all-to-all: send peer p the ranges ``send_ranges[p]`` of ``src``, receive ``send_ranges[me]``
    from every peer and write own + received (in peer order) into ``dst``. ``dst`` may be ``src`` (in place).

    Posts the messages on ``lane`` and returns the function that waits for them and sums.
    """
    if lane.phase.ring and all(len(r) == 1 for r in send_ranges):
        return _ring_reduce_exchange(lane, peers, me, [r[0] for r in send_ranges], src, src_off, dst, dst_off)
    mine = send_ranges[me]
    messages, received = [], []
    for p, peer in enumerate(peers):
        if p == me:
            continue
        for t, r in enumerate(send_ranges[p]):
            if r[1] > r[0]:
                messages.append((True, _view(src, src_off, r), peer, t))
    # Receive buffers come from the phase's scratch: fresh buffers would cost a page fault per page on every chunk.
    scratch = lane.scratch((len(peers) - 1) * _size(mine), src)
    used = 0
    for p, peer in enumerate(peers):
        if p == me:
            continue
        bufs = []
        for t, r in enumerate(mine):
            buf = scratch[used:used + r[1] - r[0]]
            used += r[1] - r[0]
            if r[1] > r[0]:
                messages.append((False, buf, peer, t))
            bufs.append(buf)
        received.append(bufs)
    ops = lane.post(peers[me], messages)

    def finish() -> None:
        for op in ops:
            op.wait()
        for t, r in enumerate(mine):
            own, out = _view(src, src_off, r), _view(dst, dst_off, r)
            if out.data_ptr() != own.data_ptr():
                out.copy_(own)
            for bufs in received:
                out.add_(bufs[t])

    return finish


def _gather_exchange(lane: _Lane, peers: list[int], me: int, ranges: list[list[Range]],
                     buf: torch.Tensor, off: int) -> Callable[[], None]:
    """All-gather by all-to-all: send ``ranges[me]`` of ``buf`` to every peer, receive ``ranges[p]`` from peer p
    straight into ``buf``. Posts the messages and returns the function that waits for them."""
    if lane.phase.ring and all(len(r) == 1 for r in ranges):
        return _ring_gather_exchange(lane, peers, me, [r[0] for r in ranges], buf, off)
    messages = []
    for p, peer in enumerate(peers):
        if p == me:
            continue
        for t, r in enumerate(ranges[me]):
            if r[1] > r[0]:
                messages.append((True, _view(buf, off, r), peer, t))
        for t, r in enumerate(ranges[p]):
            if r[1] > r[0]:
                messages.append((False, _view(buf, off, r), peer, t))
    ops = lane.post(peers[me], messages)

    def finish() -> None:
        for op in ops:
            op.wait()

    return finish


def _ring_reduce_exchange(lane: _Lane, peers: list[int], me: int, pieces: list[Range],
                          src: torch.Tensor, src_off: int, dst: torch.Tensor, dst_off: int) -> Callable[[], None]:
    """Reduce-scatter by a ring, the same contract as :func:`_reduce_exchange` with one range per peer.

    In step s (0 <= s < k - 1) each rank sends the next one its partial sum of piece ``me - 1 - s`` (its own values
    at s = 0) and receives the previous one's partial sum of piece ``me - 2 - s``, to which it adds its own values; at
    the last step that piece is its own, complete, written to ``dst``. Each rank sends (k - 1)/k of the data, one
    stream each way. The first step is posted now, the rest run in the returned function.
    """
    k = len(peers)
    nxt, prev = peers[(me + 1) % k], peers[(me - 1) % k]
    longest = max(b - a for a, b in pieces)
    scratch = lane.scratch(2 * longest, src)
    partial = (scratch[:longest], scratch[longest:])  # received into one while the other is sent

    def post(step: int) -> tuple[list, int, torch.Tensor]:
        send_piece, recv_piece = pieces[(me - 1 - step) % k], pieces[(me - 2 - step) % k]
        send = _view(src, src_off, send_piece) if step == 0 else partial[(step - 1) % 2][:_size([send_piece])]
        recv = partial[step % 2][:_size([recv_piece])]
        messages = []
        if send.numel():
            messages.append((True, send, nxt, step))
        if recv.numel():
            messages.append((False, recv, prev, step))
        return lane.post(peers[me], messages), (me - 2 - step) % k, recv

    first = post(0)

    def finish() -> None:
        ops, q, recv = first
        for step in range(k - 1):
            if step:
                ops, q, recv = post(step)
            for op in ops:
                op.wait()
            own = _view(src, src_off, pieces[q])
            if step < k - 2:
                recv.add_(own)
            else:  # q == me: the complete sum of this rank's piece
                torch.add(own, recv, out=_view(dst, dst_off, pieces[me]))

    return finish


def _ring_gather_exchange(lane: _Lane, peers: list[int], me: int, pieces: list[Range],
                          buf: torch.Tensor, off: int) -> Callable[[], None]:
    """All-gather by a ring, the same contract as :func:`_gather_exchange` with one range per peer: in step s each
    rank passes piece ``me - s`` on to the next rank and receives piece ``me - 1 - s`` from the previous one, straight
    into ``buf``."""
    k = len(peers)
    nxt, prev = peers[(me + 1) % k], peers[(me - 1) % k]

    def post(step: int) -> list:
        send, recv = _view(buf, off, pieces[(me - step) % k]), _view(buf, off, pieces[(me - 1 - step) % k])
        messages = []
        if send.numel():
            messages.append((True, send, nxt, step))
        if recv.numel():
            messages.append((False, recv, prev, step))
        return lane.post(peers[me], messages)

    first = post(0)

    def finish() -> None:
        ops = first
        for step in range(k - 1):
            if step:
                ops = post(step)
            for op in ops:
                op.wait()

    return finish


def _scatter_stage(peers: list[int], me: int, ranges_of: Callable[[int], list[list[Range]]], src: torch.Tensor,
                   src_off: int, dst: torch.Tensor, dst_off: int, divide_by: int | None = None) -> Stage:
    """A stage that reduce-scatters chunk k over ``peers`` (:func:`_reduce_exchange` of ``ranges_of(k)``, from ``src``
    into ``dst``), then divides the part this rank summed by ``divide_by`` (for ``"avg"``; ``None``: no division)."""
    def stage(k: int, lane: _Lane) -> Callable[[], None]:
        ranges = ranges_of(k)
        done = _reduce_exchange(lane, peers, me, ranges, src, src_off, dst, dst_off)
        if divide_by is None:
            return done

        def divide() -> None:
            for r in ranges[me]:
                _view(dst, dst_off, r).div_(divide_by)

        return _then(done, divide)

    return stage


def _gather_stage(peers: list[int], me: int, ranges_of: Callable[[int], list[list[Range]]],
                  buf: torch.Tensor) -> Stage:
    """A stage that all-gathers chunk k over ``peers`` in place in ``buf`` (:func:`_gather_exchange` of
    ``ranges_of(k)``)."""
    def stage(k: int, lane: _Lane) -> Callable[[], None]:
        return _gather_exchange(lane, peers, me, ranges_of(k), buf, 0)

    return stage
