"""A sharded checkpoint's view of the flat buffers: each rank's level-G range of a buffer, cut into the rectangular
chunks of the tensors it covers (:func:`range_chunks`), handed to ``torch.distributed.checkpoint`` as objects that
describe their own chunks (:class:`FlatChunks`) through planners that know them (:class:`ChunkSavePlanner`,
:class:`ChunkLoadPlanner`). The chunks are views: saving reads and loading writes the flat buffers in place."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


def range_chunks(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split the row-major element range ``[start, stop)`` of a tensor of ``shape`` into rectangular chunks.

    Returns ``(offsets, sizes, flat_start)`` per chunk; each chunk is contiguous in memory (its trailing dimensions
    are whole), so it is a view of the flat range. At most ``2 * ndim - 1`` chunks.
    """
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape), start)]
    inner = math.prod(shape[1:])
    out = []
    row, pos = start // inner, start
    if pos % inner:  # partial first row
        end = min(stop, (row + 1) * inner)
        for off, size, fs in range_chunks(shape[1:], pos - row * inner, end - row * inner):
            out.append(((row, *off), (1, *size), row * inner + fs))
        pos, row = end, row + 1
    full_end = stop // inner
    if pos < stop and full_end > row:  # whole rows
        out.append(((row, *(0,) * (len(shape) - 1)), (full_end - row, *shape[1:]), row * inner))
        pos, row = full_end * inner, full_end
    if pos < stop:  # partial last row
        for off, size, fs in range_chunks(shape[1:], 0, stop - row * inner):
            out.append(((row, *off), (1, *size), row * inner + fs))
    return out


class FlatChunks:
    """One tensor of the checkpoint as the chunks this rank holds: views into a flat buffer.

    Implements the hooks torch.distributed.checkpoint uses for tensors sharded in its own way
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``).
    """

    def __init__(self, shape: torch.Size, dtype: torch.dtype, chunks: list[tuple[tuple, tuple, torch.Tensor]]):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.chunks = chunks

    @classmethod
    def of(cls, flat: torch.Tensor, flat_base: int, slot_offset: int, shape: torch.Size, rng: tuple[int, int]):
        """The part of a parameter (at ``slot_offset`` in the padded buffer) that lies in the buffer range ``rng``;
        ``flat`` holds the buffer from element ``flat_base`` on."""
        numel = math.prod(shape)
        a, b = max(rng[0], slot_offset), min(rng[1], slot_offset + numel)
        chunks = []
        for off, size, fs in range_chunks(tuple(shape), a - slot_offset, b - slot_offset):
            begin = slot_offset + fs - flat_base
            chunks.append((off, size, flat[begin:begin + math.prod(size)].view(size)))
        return cls(shape, flat.dtype, chunks)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                                                      properties=props, size=self.shape))
                for off, size, _ in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), torch.Size(size)) for off, size, _ in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, _, view in self.chunks:
            if torch.Size(off) == index.offset:
                return view
        raise ValueError(f"{index.fqn}: no local chunk at offset {tuple(index.offset)}")


class ChunkSavePlanner(DefaultSavePlanner):
    """The default save planner, told how to find a :class:`FlatChunks` chunk."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, FlatChunks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """The default load planner, told how to find a :class:`FlatChunks` chunk."""

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        # The default set-up rewrites every value it does not know (ours) to None: hide them while it runs.
        hidden: dict[tuple, FlatChunks] = {}

        def hide(d: dict, path: tuple) -> None:
            for k, v in d.items():
                if isinstance(v, FlatChunks):
                    hidden[path + (k,)] = v
                    d[k] = None
                elif isinstance(v, dict):
                    hide(v, path + (k,))

        hide(state_dict, ())
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for path, obj in hidden.items():
            node = state_dict
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = obj
        flat_key = {tuple(v): k for k, v in self.mappings.items()} if self.flatten_state_dict else {}
        for path, obj in hidden.items():
            self.state_dict[flat_key.get(path, ".".join(map(str, path)))] = obj

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, FlatChunks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)
