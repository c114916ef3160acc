"""Checkpoints of a PaRO-sharded module: sharded (torch.distributed.checkpoint) and full (one torch file).

Sharded checkpoints hold every tensor under its original name and shape, as a set of rectangular chunks: each rank
writes the part of each parameter (and of each optimizer state) that falls into its level-G range of the flat buffer.
Those ranges partition every buffer across the n ranks, so each element is written exactly once, by one rank, and
the files can be read at any other world size, group size or strategy, or without this package
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).

Loading describes, for each rank, the chunks it needs at its own levels (P for parameters, OS for optimizer states);
torch.distributed.checkpoint reads the overlapping parts of the stored chunks into them, in place. (the chunks and their planners:
``flat_chunks.py``).

The strategy's checkpoint hooks call the functions of the last sections: what a checkpoint holds
(:func:`module_state_to_save`, :func:`optimizer_state_to_save`), writing it aside and publishing it atomically
(:func:`save`, :func:`export_full`), reading it back (:func:`load_sharded`; a full file goes through Lightning and
:func:`load_full_model_state`), and consolidating a sharded one offline (:func:`convert_to_full`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from lightning_paro.durable import fsync_dir
from lightning_paro.strategy.flat_chunks import ChunkLoadPlanner, ChunkSavePlanner, FlatChunks
from lightning_paro.strategy.levels import Level

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_paro.strategy.engine import PaROEngine

META_FILE = "meta.pt"
"""Trainer state (loops, schedulers, callbacks) of a sharded checkpoint, as Lightning's sharded layout names it."""


# ---------------------------------------------------------------------- state dicts in the checkpoint's terms
def model_state(engine: PaROEngine, for_save: bool) -> dict[str, Any]:
    """The module's state dict with parameters as :class:`FlatChunks` (every alias of a tied parameter included)."""
    out: dict[str, Any] = {}
    slots = {id(s.param): (f, s) for f in engine.flat_groups() for s in f.slots}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in slots:
            f, s = slots[id(value)]
            level = Level.G if for_save else f.spec.params
            out[key] = FlatChunks.of(f.p_local, f.layout.start(f.spec.params), s.offset, s.shape,
                                     f.layout.range(level))
        else:
            out[key] = value.detach() if torch.is_tensor(value) else value
    return out


def optimizer_state(engine: PaROEngine, opt_index: int, for_save: bool) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter name (the format of
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``), its tensors as :class:`FlatChunks`."""
    opt = engine.optimizers[opt_index]
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for gi, group in enumerate(opt.param_groups):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(engine.original_param_groups[opt_index][gi])})
        for master in group["params"]:
            f = engine.flat_of(master)
            o0, o1 = f.layout.range(f.spec.optim)
            rng = f.layout.range(Level.G) if for_save else (o0, o1)
            for s in f.slots:
                a, b = max(rng[0], s.offset), min(rng[1], s.offset + s.numel)
                entry: dict[str, Any] = {}
                for k, v in opt.state.get(master, {}).items():
                    if torch.is_tensor(v) and v.shape == master.shape:
                        entry[k] = FlatChunks.of(v, o0, s.offset, s.shape, rng)
                    else:
                        entry[k] = v  # scalars (step) are the same for every parameter of the shard
                if entry and (a < b or not for_save):
                    state[s.name] = entry
    return {"state": state, "param_groups": groups}


def init_optimizer_state(engine: PaROEngine, opt_index: int) -> None:
    """Create the optimizer's state tensors (a step with zero gradients and learning rate 0), so a checkpoint can be
    read into them; the parameters do not change."""
    opt = engine.optimizers[opt_index]
    if all(p in opt.state for g in opt.param_groups for p in g["params"]):
        return
    saved = []
    for g in opt.param_groups:
        saved.append(g["lr"])
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    backup = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    opt.step()
    with torch.no_grad():
        for p, b in zip((p for g in opt.param_groups for p in g["params"]), backup):
            p.copy_(b)
    for g, lr in zip(opt.param_groups, saved):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None
    for st in opt.state.values():  # the zero step must not count
        if "step" in st and torch.is_tensor(st["step"]):
            st["step"].zero_()


def apply_param_groups(engine: PaROEngine, opt_index: int, loaded_groups: list[dict]) -> None:
    """Set the optimizer's hyper-parameters from a loaded state dict's param groups (matched by position)."""
    opt = engine.optimizers[opt_index]
    if len(loaded_groups) != len(opt.param_groups):
        raise ValueError(f"The checkpoint's optimizer {opt_index} has {len(loaded_groups)} param groups, the"
                         f" optimizer {len(opt.param_groups)}: build the optimizer the same way to resume it.")
    for group, loaded in zip(opt.param_groups, loaded_groups):
        for k, v in loaded.items():
            if k != "params":
                group[k] = v


# ---------------------------------------------------------------------- full (consolidated) state
def full_optimizer_state(engine: PaROEngine, opt_index: int) -> dict[str, Any]:
    """Collective: the optimizer state as torch's own ``optimizer.state_dict()`` of the unsharded optimizer
    (integer keys in the original parameter order), the format Lightning's "ddp" saves and loads."""
    opt = engine.optimizers[opt_index]
    per_name: dict[str, dict[str, Any]] = {}
    for group in opt.param_groups:
        for master in group["params"]:
            f = engine.flat_of(master)
            full_states = {}
            for k, v in opt.state.get(master, {}).items():
                if torch.is_tensor(v) and v.shape == master.shape:
                    # On the shard's device: Lightning's teardown moves optimizer states to the CPU, which an NCCL
                    # group cannot carry (trainer.save_checkpoint after fit or validate).
                    full = torch.zeros(f.layout.padded, dtype=v.dtype, device=master.device)
                    scope = {Level.N: None, Level.I: "intra", Level.G: "global"}[f.spec.optim]
                    if scope is None:
                        full.copy_(v)
                    else:
                        engine.comm.all_gather(full, v.detach().to(master.device).contiguous(), scope)
                    full_states[k] = full
                else:
                    full_states[k] = v
            for s in f.slots:
                per_name[s.name] = {k: (t[s.offset:s.offset + s.numel].view(s.shape).detach().cpu().clone()
                                        if torch.is_tensor(t) and t.dim() == 1 and t.numel() == f.layout.padded
                                        else (t.detach().cpu().clone() if torch.is_tensor(t) else t))
                                    for k, t in full_states.items()}
    state, groups, index = {}, [], 0
    for gi, group in enumerate(opt.param_groups):
        ids = []
        for name in engine.original_param_groups[opt_index][gi]:
            if name in per_name:
                state[index] = per_name[name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def load_full_model_state(engine: PaROEngine, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy a full (unsharded) model state dict into this rank's shards; no collectives."""
    current = engine.module.state_dict(keep_vars=True)
    check_keys_and_shapes(current, {k: v.shape for k, v in state_dict.items() if torch.is_tensor(v)},
                          strict, "model")
    slots = {id(s.param): (f, s) for f in engine.flat_groups() for s in f.slots}
    with torch.no_grad():
        for key, value in current.items():
            if key not in state_dict:
                continue
            src = state_dict[key]
            if id(value) in slots:
                f, s = slots[id(value)]
                _copy_range(f.p_local, f.layout.start(f.spec.params), f.layout.range(f.spec.params), s.offset,
                            src.reshape(-1))
                if f.trainable and f.master.data_ptr() != f.own_param_slot.data_ptr():
                    f.master.copy_(f.own_param_slot)
            elif torch.is_tensor(value):
                value.copy_(src)


def load_full_optimizer_state(engine: PaROEngine, opt_index: int, sd: dict[str, Any]) -> None:
    """Load torch's ``optimizer.state_dict()`` format (integer keys in the original order, or parameter names)."""
    init_optimizer_state(engine, opt_index)
    opt = engine.optimizers[opt_index]
    order = [n for g in engine.original_param_groups[opt_index] for n in g]
    loaded_groups = sd["param_groups"]
    flat_ids = [p for g in loaded_groups for p in g["params"]]
    if len(flat_ids) != len(order):
        raise ValueError(f"The checkpoint's optimizer {opt_index} covers {len(flat_ids)} parameters, this model's"
                         f" {len(order)}: it was saved for a different model or optimizer set-up.")
    by_name = {}
    for pid, name in zip(flat_ids, order):
        key = name if isinstance(pid, str) else pid
        if key in sd["state"]:
            by_name[name] = sd["state"][key]
    with torch.no_grad():
        for group in opt.param_groups:
            for master in group["params"]:
                f = engine.flat_of(master)
                o0, o1 = f.layout.range(f.spec.optim)
                for k, v in opt.state[master].items():
                    if torch.is_tensor(v) and v.shape == master.shape:
                        v.zero_()
                        for s in f.slots:
                            if s.name in by_name and k in by_name[s.name]:
                                _copy_range(v, o0, (o0, o1), s.offset, by_name[s.name][k].reshape(-1))
                    elif k == "step":
                        steps = [float(by_name[s.name]["step"]) for s in f.slots if s.name in by_name]
                        if steps:
                            if torch.is_tensor(v):
                                v.fill_(max(steps))
                            else:
                                opt.state[master][k] = max(steps)
    apply_param_groups(engine, opt_index, loaded_groups)


def _copy_range(dst: torch.Tensor, dst_base: int, rng: tuple[int, int], slot_offset: int, src_flat: torch.Tensor):
    a, b = max(rng[0], slot_offset), min(rng[1], slot_offset + src_flat.numel())
    if a < b:
        dst[a - dst_base:b - dst_base].copy_(src_flat[a - slot_offset:b - slot_offset])


def check_keys_and_shapes(current: dict[str, Any], stored: dict[str, torch.Size], strict: bool, what: str) -> None:
    """Fail early, naming every missing key, unexpected key and shape mismatch."""
    problems = []
    cur_shapes = {k: tuple(v.shape) for k, v in current.items() if torch.is_tensor(v)}
    missing = [k for k in cur_shapes if k not in stored]
    unexpected = [k for k in stored if k not in cur_shapes]
    if strict and missing:
        problems.append(f"missing keys: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
    if strict and unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected[:10])}" + (" ..." if len(unexpected) > 10 else ""))
    bad = [f"{k} {tuple(stored[k])} in the checkpoint vs {cur_shapes[k]} in the model" for k in cur_shapes
           if k in stored and tuple(stored[k]) != cur_shapes[k]]
    if bad:
        problems.append("shape mismatches: " + "; ".join(bad[:10]))
    if problems:
        raise ValueError(f"The checkpoint does not match the {what}: " + " | ".join(problems)
                         + ". Load it into the model it was saved from, or set `strict_loading = False` on the LightningModule to"
                         " skip missing and unexpected keys.")


# ---------------------------------------------------------------------- atomic publishing
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
        return optimizer_state(engine, index, for_save=True)
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


def remove(path: Path) -> None:
    """Delete a checkpoint, a file or a sharded directory (call it on one rank)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


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


def export_full(ranks: Ranks, engine: PaROEngine, path: Any) -> None:
    """Write the module's full state dict (``torch.save``) to ``path`` from rank 0, gathering one unit at a time
    onto rank 0's CPU (collective); published atomically."""
    state = engine.full_state_dict(rank0_only=True)
    path = Path(ranks.broadcast(str(path)))
    if ranks.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = staging_path(path)
        torch.save(state, staged)
        publish(staged, path)
    ranks.barrier()


# ---------------------------------------------------------------------- sharded -> full
def _names_to_indices(osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name -> torch's own format (integer keys in group order)."""
    state, groups, index = {}, [], 0
    for group in osd["param_groups"]:
        ids = []
        for name in group["params"]:
            if name in osd["state"]:
                state[index] = osd["state"][name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


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
        out["optimizer_states"] = [_names_to_indices(flat[k]) for k in opts]
    return out


def convert_to_full(src: str | Path, dst: str | Path, weights_only: bool = True) -> Path:
    """Consolidate a sharded checkpoint directory into one file in Lightning's format (:func:`read_full`), published
    atomically. Runs in one process, with no distributed set-up."""
    out = read_full(src, weights_only=weights_only)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(dst)
    torch.save(out, staged)
    publish(staged, dst)
    return dst
