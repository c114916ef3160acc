"""Checkpoints of a PaRO-sharded module: sharded (torch.distributed.checkpoint) and full (one torch file), as files.

Sharded checkpoints hold every tensor under its original name and shape, as a set of rectangular chunks: each rank
writes the part of each parameter (and of each optimizer state) that falls into its level-G range of the flat buffer.
Those ranges partition every buffer across the n ranks, so each element is written exactly once, by one rank, and
the files can be read at any other world size, group size or strategy, or without this package
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``). Loading describes, for each rank, the chunks it
needs at its own levels (P for parameters, OS for optimizer states); torch.distributed.checkpoint reads the
overlapping parts of the stored chunks into them, in place. What the state dicts hold, sharded or full, is
``state_dicts.py``; the chunks and their planners are ``flat_chunks.py``.

This module holds the files and the orchestration. Files: a checkpoint is written aside under a hidden name
(:func:`staging_path`) and published with an atomic rename (:func:`publish`, :func:`save_file`); a sharded one is a
directory whose trainer state (:data:`META_FILE`) is written last (:func:`is_sharded_checkpoint`,
:func:`read_sharded_metadata`). Orchestration, called by the strategy's checkpoint hooks: what a checkpoint holds
(:func:`module_state_to_save`, :func:`optimizer_state_to_save`), writing it (:func:`save`, :func:`export_full`),
reading a sharded one back (:func:`load_sharded`; a full file goes through Lightning and
``state_dicts.load_full_model_state``), and consolidating a sharded one offline (:func:`read_full`,
:func:`convert_to_full`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_paro.durable import fsync_dir
from lightning_paro.strategy.flat_chunks import ChunkLoadPlanner, ChunkSavePlanner
from lightning_paro.strategy.state_dicts import (
    ERROR_FEEDBACK,
    apply_param_groups,
    check_keys_and_shapes,
    error_feedback_state,
    full_optimizer_state,
    init_optimizer_state,
    model_state,
    names_to_indices,
    optimizer_state,
)

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_paro.strategy.engine import PaROEngine

META_FILE = "meta.pt"
"""Trainer state (loops, schedulers, callbacks) of a sharded checkpoint, as Lightning's sharded layout names it."""


# ---------------------------------------------------------------------- files: written aside, published atomically
def staging_path(path: Path) -> Path:
    """Where a checkpoint is written before it is published: a sibling that no loader mistakes for it."""
    return path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")


def publish(staged: Path, path: Path) -> None:
    """Atomically move a complete checkpoint into place; an existing one is replaced only once the new one is in."""
    if staged.is_file():
        with open(staged, "rb") as fh:
            os.fsync(fh.fileno())
    else:
        for p in staged.rglob("*"):
            if p.is_file():
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    os.replace(staged, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def save_file(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` (its folder created), written aside and published atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(path)
    torch.save(obj, staged)
    publish(staged, path)


def remove(path: Path) -> None:
    """Delete a checkpoint, a file or a sharded directory (call it on one rank)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file()


def read_sharded_metadata(path: Path):
    """The torch.distributed.checkpoint metadata of a sharded checkpoint, with a clear error when it is not one."""
    from torch.distributed.checkpoint import FileSystemReader

    if not path.is_dir():
        aside = sorted(path.parent.glob(f".{path.name}.old-*"))
        hint = (f" A save interrupted while replacing it left the previous checkpoint at {aside[-1]}: rename it back"
                f" to {path.name} to use it.") if aside else ""
        raise FileNotFoundError(f"No checkpoint directory at {path}.{hint}")
    if not (path / META_FILE).is_file() or not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a complete sharded checkpoint: it lacks {META_FILE} or .metadata (an"
                         " interrupted save leaves only hidden '.partial' directories; use the previous checkpoint).")
    return FileSystemReader(str(path)).read_metadata()


def stored_shapes(metadata, prefix: str) -> dict[str, torch.Size]:
    """The shapes of the tensors a sharded checkpoint stores under ``prefix.``, keyed without the prefix."""
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix + ".") and hasattr(md, "size"):
            out[key[len(prefix) + 1:]] = md.size
    return out


# ---------------------------------------------------------------------- the strategy's hooks, end to end
class Ranks(Protocol):
    """What saving and loading need of the strategy: whether this is rank 0, and its collectives."""

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: Optional[str] = None) -> None: ...


def module_state_to_save(engine: PaROEngine, sharded: bool) -> dict[str, Any]:
    """The module's state for a checkpoint. Sharded: this rank's chunks of every tensor. Full: the whole state dict
    (collective; rank 0 saves it), one unit gathered at a time and copied to the CPU, so that a full checkpoint never
    needs the whole model on the device."""
    if sharded:
        engine.wait()
        return model_state(engine, for_save=True)
    return engine.full_state_dict(device="cpu")


def optimizer_state_to_save(engine: PaROEngine, optimizer: Optimizer, sharded: bool) -> dict[str, Any]:
    """The state of ``optimizer`` (one the engine steps) for a checkpoint: this rank's chunks, or the full state
    (collective)."""
    index = next((i for i, o in enumerate(engine.optimizers) if o is optimizer), None)
    if index is None:
        raise RuntimeError(
            f"The optimizer {type(optimizer).__name__} of the last fit no longer holds this module's shards: the"
            " module's parameters were replaced after fit (e.g. a `configure_model` that builds new layers on every"
            " call), so the strategy sharded them anew. Save the checkpoint before validate/test/predict, or make"
            " `configure_model` return early when the layers exist.")
    engine.wait()
    if sharded:
        state = optimizer_state(engine, index, for_save=True)
        feedback = error_feedback_state(engine, index)
        if feedback:  # each rank's own row, beside its optimizer shard
            state[ERROR_FEEDBACK] = feedback
        return state
    return full_optimizer_state(engine, index)


def save(ranks: Ranks, checkpoint: dict[str, Any], filepath: Any, sharded: bool,
         write_file: Callable[[dict[str, Any], Path], None]) -> None:
    """Write a checkpoint aside, then publish it atomically (collective): an interrupted save never leaves a
    checkpoint that looks complete, and the previous one at ``filepath`` stays intact until the new one is in place.

    Sharded: a directory written by every rank through torch.distributed.checkpoint, the trainer state
    (:data:`META_FILE`) last. Full: ``write_file(checkpoint, path)`` on rank 0 (the strategy's CheckpointIO).
    """
    path = Path(ranks.broadcast(str(filepath)))
    staged = Path(ranks.broadcast(str(staging_path(path))))
    if sharded:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        state = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = opt_state
        if ranks.is_global_zero:
            staged.mkdir(parents=True)
        ranks.barrier()
        dcp_save(state, storage_writer=FileSystemWriter(str(staged)), planner=ChunkSavePlanner())
        if ranks.is_global_zero:
            torch.save(checkpoint, staged / META_FILE)  # written last: its presence marks completeness
    elif ranks.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(checkpoint, staged)
    ranks.barrier()
    if ranks.is_global_zero:
        publish(staged, path)
    ranks.barrier()


def load_sharded(engine: PaROEngine, path: Path, strict: bool, fitting: bool, weights_only: bool) -> dict[str, Any]:
    """Read a sharded checkpoint into the engine's shards in place (collective) and return its trainer state.

    The optimizer states are read for fit only, as Lightning does for "ddp": ``validate(ckpt_path=...)`` after fit
    reads the weights and leaves the fit's optimizer states as they are.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    metadata = read_sharded_metadata(path)
    state: dict[str, Any] = {"state_dict": model_state(engine, for_save=False)}
    check_keys_and_shapes(engine.module.state_dict(keep_vars=True), stored_shapes(metadata, "state_dict"), strict,
                          "model")
    stored_opts = {k.split(".")[0] for k in metadata.state_dict_metadata if k.startswith("optimizer_")}
    load_opts = [i for i in range(len(engine.optimizers)) if f"optimizer_{i}" in stored_opts] if fitting else []
    for i in load_opts:
        init_optimizer_state(engine, i)
        state[f"optimizer_{i}"] = optimizer_state(engine, i, for_save=False)
        _keep_stored_entries(state[f"optimizer_{i}"]["state"], f"optimizer_{i}.state", metadata.state_dict_metadata)
        feedback = _error_feedback_to_load(engine, i, stored_shapes(metadata, f"optimizer_{i}.{ERROR_FEEDBACK}"))
        if feedback:
            state[f"optimizer_{i}"][ERROR_FEEDBACK] = feedback
    if not strict:
        state["state_dict"] = {k: v for k, v in state["state_dict"].items()
                               if f"state_dict.{k}" in metadata.state_dict_metadata}
    try:
        dcp_load(state, storage_reader=FileSystemReader(str(path)), planner=ChunkLoadPlanner())
    except CheckpointException as err:  # a BaseException: turn it into an error that names the damage
        causes = "; ".join(f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                           for r, e in sorted(err.failures.items()))
        raise RuntimeError(f"Could not read the sharded checkpoint at {path}: a data file is missing, damaged or"
                           f" truncated ({causes}). Resume from an earlier checkpoint.") from None
    for i in load_opts:
        apply_param_groups(engine, i, state[f"optimizer_{i}"]["param_groups"])
    engine.after_load()
    return torch.load(path / META_FILE, weights_only=weights_only)


def _keep_stored_entries(state: dict[str, dict[str, Any]], prefix: str, stored: Any) -> None:
    """Drop from an optimizer's ``state`` (by parameter name) the entries the checkpoint does not hold: they keep the
    zeros :func:`init_optimizer_state` gave them. A checkpoint written by FSDP2 (or any torch optimizer) holds no state
    for a parameter that never received a gradient, where this engine writes zeros; so reading it is the same."""
    absent = []
    for name, entry in list(state.items()):
        for key in [k for k in entry if f"{prefix}.{name}.{k}" not in stored]:
            del entry[key]
            absent.append(name)
        if not entry:
            del state[name]
    if absent:
        names = sorted(set(absent))
        rank_zero_info(f"PaRO: the checkpoint holds no optimizer state for {len(names)} parameter(s), which start"
                       f" from zero state as in a new optimizer (a parameter that never received a gradient):"
                       f" {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}.")


def _error_feedback_to_load(engine: PaROEngine, opt_index: int, stored: dict[str, torch.Size]) -> dict[str, Any]:
    """The error-feedback buffers of optimizer ``opt_index`` to read from a sharded checkpoint: those stored for the
    same world and group size (the same ``(n, L/m)`` shape: each rank reads its own row). The others are reset to
    zero with a logged note: a rank's buffer holds what its own sends left out, which another layout's ranks did not
    send, so it has no meaning there."""
    wanted = error_feedback_state(engine, opt_index)
    reset = []
    for name, chunks in list(wanted.items()):
        if stored.get(name) != chunks.shape:
            found = "none stored" if name not in stored else f"stored {tuple(stored[name])}"
            reset.append(f"{name} ({found}, this layout's {tuple(chunks.shape)})")
            for _, _, view in chunks.chunks:
                view.zero_()
            del wanted[name]
    if reset:
        topo = engine.comm.topology
        rank_zero_info(f"PaRO: the error feedback of the quantized gradient hop starts from zero for {len(reset)}"
                       f" buffer(s) of optimizer {opt_index}: the checkpoint holds none for {topo.world_size} ranks"
                       f" in {topo.num_groups} groups: {', '.join(reset[:5])}{' ...' if len(reset) > 5 else ''}.")
    return wanted


def export_full(ranks: Ranks, engine: PaROEngine, path: Any) -> None:
    """Write the module's full state dict (``torch.save``) to ``path`` from rank 0, gathering one unit at a time
    onto rank 0's CPU (collective); published atomically."""
    state = engine.full_state_dict(rank0_only=True)
    path = Path(ranks.broadcast(str(path)))
    if ranks.is_global_zero:
        save_file(state, path)
    ranks.barrier()


# ---------------------------------------------------------------------- sharded -> full
def read_full(src: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """A sharded checkpoint directory consolidated in memory, on the CPU, in Lightning's format (the one ``"ddp"``
    writes): ``state_dict`` with full tensors, ``optimizer_states`` in torch's own format, and the trainer state.

    Runs in one process, with no distributed set-up; the whole checkpoint passes through host memory once.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = Path(src)
    read_sharded_metadata(src)
    with tempfile.TemporaryDirectory() as tmp:
        consolidated = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(src), str(consolidated))
        flat = torch.load(consolidated, map_location="cpu", weights_only=True)
    out = dict(torch.load(src / META_FILE, map_location="cpu", weights_only=weights_only))
    out["state_dict"] = flat["state_dict"]
    opts = sorted((k for k in flat if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    if opts:
        out["optimizer_states"] = [names_to_indices(flat[k]) for k in opts]
    return out


def convert_to_full(src: str | Path, dst: str | Path, weights_only: bool = True) -> Path:
    """Consolidate a sharded checkpoint directory into one file in Lightning's format (:func:`read_full`), published
    atomically. Runs in one process, with no distributed set-up."""
    dst = Path(dst)
    save_file(read_full(src, weights_only=weights_only), dst)
    return dst
