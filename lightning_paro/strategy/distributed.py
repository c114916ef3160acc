"""The strategy's process groups and the collectives Lightning asks of a strategy, as plain functions.

The default group is initialised with the device's own backend and gloo beside it for CPU tensors
(:func:`default_process_group_backend`), and with the strategy's ``timeout`` (:func:`init_default_group`).
:func:`barrier`, :func:`broadcast_object` and :func:`all_reduce` are Lightning's ``barrier``, ``broadcast`` and
``reduce``; the strategy (``strategy.py``) runs each on the engine's communication thread, after the collectives
issued before it.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor

from lightning_paro.comm.topology import Topology


def default_process_group_backend(device: torch.device) -> str:
    """The backend the strategy initialises the default group with: the device's own (NCCL on CUDA) with gloo beside
    it for CPU tensors (``"cuda:nccl,cpu:gloo"``), which Lightning's object broadcasts and any CPU tensor handed to a
    collective need; plain gloo on CPU."""
    own = _get_default_process_group_backend_for_device(device)
    if device.type == "cpu" or own == "gloo" or not dist.is_gloo_available():
        return own
    return f"{device.type}:{own},cpu:gloo"


def init_default_group(cluster_environment: Optional[ClusterEnvironment], backend: str, device: torch.device,
                       timeout: Optional[timedelta]) -> None:
    """Initialise torch's default process group, unless it exists, with ``backend`` and ``timeout`` (bound to
    ``device`` off the CPU)."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    initialised_here = not _distributed_is_initialized()
    _init_dist_connection(cluster_environment, backend, **kwargs)
    if initialised_here and "nccl" in backend and backend != "nccl":
        # As Lightning does for plain "nccl" (torch warns at exit about an NCCL group left undestroyed).
        atexit.register(_destroy_dist_connection)


def same_layout(current: Optional[Topology], new: Topology) -> bool:
    """Whether ``current`` has ``new``'s world size, group size and rank: the groups built for it still serve."""
    return current is not None and (current.world_size, current.group_size, current.rank) == (
        new.world_size, new.group_size, new.rank)


def barrier(device: torch.device) -> None:
    """A barrier over the default group (under NCCL, on ``device``)."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int) -> Any:
    """``obj`` as rank ``src`` holds it, on every rank of the default group."""
    holder = [obj]
    dist.broadcast_object_list(holder, src, group=_group.WORLD)
    return holder[0]


def all_reduce(tensor: Tensor, group: Optional[Any], reduce_op: Optional[Union[ReduceOp, str]]) -> Tensor:
    """Lightning's reduce (its ``_sync_ddp``) in place, with a mean taken as a sum divided by the group size on every
    backend (gloo has no AVG, and a CPU tensor goes to gloo under a ``"cuda:nccl,cpu:gloo"`` backend), and without
    the barrier before it (the all-reduce waits for every rank anyway)."""
    group = dist.group.WORLD if group is None else group
    mean = False
    if isinstance(reduce_op, str):
        mean = reduce_op.lower() in ("mean", "avg")
        op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, reduce_op.upper())
    elif reduce_op is None or reduce_op == dist.ReduceOp.AVG:
        mean = reduce_op is not None
        op = dist.ReduceOp.SUM
    else:
        op = reduce_op
    dist.all_reduce(tensor, op=op, group=group)
    if not mean:
        return tensor
    size = dist.get_world_size(group)
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
