"""Differences between the torch and Lightning versions the package supports, in one place.

Code elsewhere calls these names (as ``compat.NAME``, so a test can patch them) and never tests versions itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's equal ``input`` into the flat ``output``, in rank order.

    torch 2.13 renamed ``all_gather_into_tensor`` (and warns that the old name is deprecated); older versions have only
    the old name, which takes the same arguments.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum the flat ``input`` over the ranks and keep this rank's equal slice in ``output`` (renamed like
    :func:`all_gather_single`, from ``reduce_scatter_tensor``)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)
