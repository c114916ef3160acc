"""The engine's shards as state dicts in a checkpoint's terms: no files, and no collectives but one gather.

Sharded views (:func:`model_state`, :func:`optimizer_state`) hold every tensor under its original name and shape as
:class:`~lightning_paro.strategy.flat_chunks.FlatChunks` over the flat buffers, so torch.distributed.checkpoint
reads and writes the shards in place; the optimizer's is keyed by parameter name, the format of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``. Before a checkpoint is read into them the
optimizer's state tensors must exist (:func:`init_optimizer_state`); its hyper-parameters come from the loaded param
groups (:func:`apply_param_groups`).

Full (consolidated) state is the format Lightning's ``"ddp"`` saves and loads: whole tensors, and optimizer states in
torch's own ``optimizer.state_dict()`` format (integer keys in the original parameter order, :func:`names_to_indices`).
:func:`full_optimizer_state` gathers it (collective); :func:`load_full_model_state` and
:func:`load_full_optimizer_state` copy such a state into this rank's shards, after :func:`check_keys_and_shapes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_paro.strategy.flat_chunks import FlatChunks
from lightning_paro.strategy.levels import Level
from lightning_paro.strategy.optimizer_shards import is_shard_state

if TYPE_CHECKING:
    from lightning_paro.strategy.engine import PaROEngine
    from lightning_paro.strategy.flat import FlatGroup, ParamSlot


# ---------------------------------------------------------------------- sharded views
def model_state(engine: PaROEngine, for_save: bool) -> dict[str, Any]:
    """The module's state dict with parameters as :class:`FlatChunks` (every alias of a tied parameter included)."""
    out: dict[str, Any] = {}
    slots = _slots_by_param(engine)
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
    for group in opt.param_groups:
        for master in group["params"]:
            f = engine.flat_of(master)
            o0, o1 = f.layout.range(f.spec.optim)
            rng = f.layout.range(Level.G) if for_save else (o0, o1)
            for s in f.slots:
                a, b = max(rng[0], s.offset), min(rng[1], s.offset + s.numel)
                entry: dict[str, Any] = {}
                for k, v in opt.state.get(master, {}).items():
                    if is_shard_state(v, master):
                        entry[k] = FlatChunks.of(v, o0, s.offset, s.shape, rng)
                    else:
                        entry[k] = v  # scalars (step) are the same for every parameter of the shard
                if entry and (a < b or not for_save):
                    state[s.name] = entry
    return {"state": state, "param_groups": _named_param_groups(engine, opt_index)}


ERROR_FEEDBACK = "paro_error_feedback"
"""The key, in an optimizer's sharded state, of the error-feedback buffers of its flat groups (``inter_quant`` with
``error_feedback``): one per flat group, keyed by its first parameter's name, stored as an ``(n, L/m)`` tensor whose
row r is global rank r's buffer. torch's own optimizer format (:func:`names_to_indices`) leaves it out."""


def error_feedback_state(engine: PaROEngine, opt_index: int) -> dict[str, FlatChunks]:
    """The error-feedback buffers of the optimizer's flat groups, each this rank's row of an ``(n, L/m)`` tensor
    (:data:`ERROR_FEEDBACK`): every rank writes and reads its own row, as it does its optimizer shard."""
    out: dict[str, FlatChunks] = {}
    for group in engine.optimizers[opt_index].param_groups:
        for master in group["params"]:
            f = engine.flat_of(master)
            if f.quant_error is not None:
                out[f.slots[0].name] = _own_row(f.quant_error, f.comm.topology)
    return out


def _own_row(buffer: torch.Tensor, topology) -> FlatChunks:
    """``buffer`` as row ``topology.rank`` of a ``(world_size, buffer.numel())`` tensor."""
    width, rank = buffer.numel(), topology.rank
    return FlatChunks.of(buffer, rank * width, 0, torch.Size((topology.world_size, width)),
                         (rank * width, (rank + 1) * width))


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
def names_to_indices(osd: dict[str, Any]) -> dict[str, Any]:
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
                if is_shard_state(v, master):
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
    return names_to_indices({"state": per_name, "param_groups": _named_param_groups(engine, opt_index)})


def load_full_model_state(engine: PaROEngine, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy a full (unsharded) model state dict into this rank's shards; no collectives."""
    current = engine.module.state_dict(keep_vars=True)
    check_keys_and_shapes(current, {k: v.shape for k, v in state_dict.items() if torch.is_tensor(v)},
                          strict, "model")
    slots = _slots_by_param(engine)
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
                    if is_shard_state(v, master):
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
    feedback = error_feedback_state(engine, opt_index)
    if feedback:  # torch's format has no place for it: what this rank's sends left out before is not known
        for chunks in feedback.values():
            for _, _, view in chunks.chunks:
                view.zero_()
        rank_zero_info(f"PaRO: the error feedback of the quantized gradient hop starts from zero for"
                       f" {len(feedback)} buffer(s) of optimizer {opt_index}: a full checkpoint does not hold it"
                       " (a sharded one does).")


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


# ---------------------------------------------------------------------- helpers
def _slots_by_param(engine: PaROEngine) -> dict[int, tuple[FlatGroup, ParamSlot]]:
    """Every sharded parameter (by ``id``) -> its flat group and its slot there."""
    return {id(s.param): (f, s) for f in engine.flat_groups() for s in f.slots}


def _named_param_groups(engine: PaROEngine, opt_index: int) -> list[dict[str, Any]]:
    """The optimizer's param groups, their hyper-parameters as they are and ``params`` the original parameter names."""
    opt = engine.optimizers[opt_index]
    return [{**{k: v for k, v in group.items() if k != "params"},
             "params": list(engine.original_param_groups[opt_index][gi])} for gi, group in enumerate(opt.param_groups)]


def per_element_keys(optimizer, master: torch.Tensor) -> frozenset[str]:
    """The keys of ``optimizer``'s state for ``master`` whose tensors are shards: one entry per element of it."""
    return frozenset(k for k, v in optimizer.state.get(master, {}).items() if is_shard_state(v, master))


def _copy_range(dst: torch.Tensor, dst_base: int, rng: tuple[int, int], slot_offset: int, src_flat: torch.Tensor):
    """Copy the part of a slot (``src_flat``, starting at flat index ``slot_offset``) that falls into ``rng`` to
    ``dst``, which starts at flat index ``dst_base``."""
    a, b = max(rng[0], slot_offset), min(rng[1], slot_offset + src_flat.numel())
    if a < b:
        dst[a - dst_base:b - dst_base].copy_(src_flat[a - slot_offset:b - slot_offset])
