"""Deferred initialisation: a model built on the meta device is given its values one unit at a time, straight into
this rank's shards, so that no rank ever holds the whole model.

The rule (:func:`initialise`): the model's construction is replayed, module by module, on CPU tensors with the CPU
random generator, in the order a CPU build runs it:

* every module's ``reset_parameters()`` (the ``torch.nn`` convention), children before their parent (a constructor
  builds its children before it initialises its own tensors), siblings in registration order;
* inside a Hugging Face ``PreTrainedModel`` (duck-typed: ``_initialize_weights`` and ``_init_weights``), those
  ``reset_parameters()`` calls only draw (the model's ``post_init`` overwrites their values, as in a CPU build), and
  the model's own ``_initialize_weights`` then runs on each module, children before parents, as ``post_init`` runs it;
* a parameter held by several modules (tied weights) takes the values of the first module in that order; the later
  ones initialise a stand-in of the same shape and discard it, so that the generator advances as in the CPU build,
  where they initialised a tensor of their own before the tie;
* buffers are initialised by the same calls (BatchNorm statistics, rotary caches by Hugging Face's hook) and kept
  whole on every rank, on the compute device.

Every rank starts from rank 0's CPU generator state (one broadcast) and computes the same values; the process's own
generator state is left as it was. So the values equal those of the same model built on CPU from the generator state
the strategy sets it up with (``seed_everything(s)`` or ``torch.manual_seed(s)`` before the build, nothing drawn in
between), provided its construction draws only through these calls. A meta tensor that no call writes (a module
without ``reset_parameters``, or one its model's hook does not cover) is an error naming the module.

Memory: the tensors of the unit being initialised, on CPU, plus those of the root unit (modules outside every unit
come before and after the units in module order, so they are written last); each unit's values go into this rank's
shards (:meth:`FlatGroup.write_shard`) and are dropped before the next unit. With a ``source`` of pretrained weights
(``loading.py``) the values it holds replace those of the rule, read slice by slice for this rank's shards only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from lightning_paro.comm.collectives import Communicator

if TYPE_CHECKING:
    from lightning_paro.strategy.flat import FlatGroup


class WeightsSource(Protocol):
    """Pretrained values by parameter or buffer name (``loading.py``): opened once per unit."""

    def open(self) -> contextlib.AbstractContextManager[WeightsReader]: ...


class WeightsReader(Protocol):
    def find(self, names: list[str]) -> str | None:
        """The first of ``names`` the weights hold (a tied parameter has several), or None."""

    def read(self, name: str, span: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``name``, or the elements ``[start, stop)`` of it flattened."""


SOURCE_ATTR = "_paro_weights_source"
"""The attribute of a meta-built module that names the pretrained weights set-up fills it from
(``loading.init_from_pretrained``)."""


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def move_materialised(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for its tensors that have values; meta tensors stay (set-up materialises them there)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


@dataclass
class _Call:
    module: nn.Module
    fn: Callable[[], object]
    keep: bool
    """Whether the values it writes are kept (False: it only advances the generator, on stand-ins)."""


def initialise(module: nn.Module, unit_modules: list[nn.Module], flats_of_unit: list[list[FlatGroup]],
               pending: set[int], comm: Communicator, source: WeightsSource | None = None) -> None:
    """Give every meta tensor of ``module`` its values by the rule of this module's docstring, one unit at a time:
    parameters (``pending``: their ids) into this rank's shards of ``flats_of_unit`` (per unit, in the order of
    ``unit_modules``; the root unit last, not in ``unit_modules``), buffers onto the compute device. Collective
    (one broadcast of the generator state)."""
    calls = _calls(module, pending)
    unit_of = {}
    for i, umod in enumerate(unit_modules):
        for m in umod.modules():
            unit_of.setdefault(id(m), i)
    root = len(unit_modules)
    last_call = {}
    for k, call in enumerate(calls):
        if call.keep:
            last_call[unit_of.get(id(call.module), root)] = k
    # a unit no call writes is finished (and its missing values reported) before the first call
    finish_at: dict[int, list[int]] = {}
    for u in range(root):
        finish_at.setdefault(last_call.get(u, -1), []).append(u)
    device = comm.device or torch.device("cpu")
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    staged: dict[int, int] = {}  # parameter id -> id of the module whose call keeps its values
    done: set[int] = set()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.set_rng_state(_rank0_rng_state(comm))
        for u in finish_at.get(-1, []):
            _finish(flats_of_unit[u], staged, done, names, source)
        for k, call in enumerate(calls):
            with _staged(call, pending, staged, done):
                call.fn()
            for u in finish_at.get(k, []):
                _finish(flats_of_unit[u], staged, done, names, source)
        _finish(flats_of_unit[root], staged, done, names, source)
    _buffers_to(module, device, source)
    missing = [names.get(pid, ["?"])[0] for pid in pending - done]
    if missing:
        raise RuntimeError(f"Deferred initialisation left parameters without values: {missing[:5]}.")


def _calls(module: nn.Module, pending: set[int]) -> list[_Call]:
    """The initialisation calls of a CPU build of ``module``, in order (see the module docstring)."""
    calls: list[_Call] = []
    seen: set[int] = set()
    hf_done: set[int] = set()

    def has_pending(m: nn.Module) -> bool:
        return any(id(p) in pending for p in m.parameters(recurse=False)) or any(
            b.is_meta for b in m.buffers(recurse=False))

    def visit(m: nn.Module, hf: nn.Module | None) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        inner = m if _is_hf_model(m) else hf
        for child in m.children():
            visit(child, inner)
        reset = getattr(m, "reset_parameters", None)
        if callable(reset) and has_pending(m):
            calls.append(_Call(m, reset, keep=inner is None))
        if inner is m:  # the model's post_init, over the modules it has not initialised yet
            for x, init_model in _hf_order(m):
                if id(x) not in hf_done:
                    hf_done.add(id(x))
                    calls.append(_Call(x, _hf_init(init_model, x), keep=True))

    visit(module, None)
    return calls


def _is_hf_model(m: nn.Module) -> bool:
    return callable(getattr(m, "_initialize_weights", None)) and callable(getattr(m, "_init_weights", None))


def _hf_order(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
    """Hugging Face's ``smart_apply``: children before parents, each module initialised by its nearest enclosing
    model."""
    def walk(m: nn.Module, init_model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
        for child in m.children():
            yield from walk(child, child if _is_hf_model(child) else init_model)
        yield m, init_model
    yield from walk(model, model)


def _hf_init(model: nn.Module, module: nn.Module) -> Callable[[], object]:
    def run() -> object:
        from transformers import initialization  # only for a Hugging Face model

        custom = model.is_custom_code() if callable(getattr(model, "is_custom_code", None)) else False
        with initialization.guard_torch_init_functions():
            return model._initialize_weights(module, custom)
    return run


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped like ``t``, filled with NaN where it can be (so that values no call writes show)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.fill_(float("nan")) if out.is_floating_point() or out.is_complex() else out.zero_()


@contextlib.contextmanager
def _staged(call: _Call, pending: set[int], staged: dict[int, int], done: set[int]) -> Iterator[None]:
    """Give ``call.module``'s own meta tensors CPU storage for the call. Kept: a parameter's ``.data`` (recorded in
    ``staged``, by the id of the module that owns its values: the first to initialise it), a buffer in the module.
    A stand-in, dropped after the call, for what the call does not keep or another module initialised first."""
    m = call.module
    swapped: list[tuple[dict, str, object]] = []
    for name, p in list(m._parameters.items()):
        if p is None or id(p) not in pending:
            continue
        if call.keep and id(p) not in staged and id(p) not in done:
            p.data = _fresh(p)
            staged[id(p)] = id(m)
        elif not call.keep or staged.get(id(p)) != id(m):
            swapped.append((m._parameters, name, p))
            m._parameters[name] = nn.Parameter(_fresh(p), requires_grad=p.requires_grad)
    for name, b in list(m._buffers.items()):
        if b is not None and b.is_meta:
            if not call.keep:
                swapped.append((m._buffers, name, b))
            m._buffers[name] = _fresh(b)
    try:
        yield
    finally:
        for table, name, original in swapped:
            table[name] = original


def _finish(flats: list[FlatGroup], staged: dict[int, int], done: set[int], names: dict[int, list[str]],
            source: WeightsSource | None) -> None:
    """A unit's values are final: write this rank's shard of each parameter (from ``source`` where it holds them),
    point the parameters back at the flat buffers and drop the staged copies."""
    flats = [f for f in flats if f.deferred]
    if not flats:
        return
    with source.open() if source is not None else contextlib.nullcontext() as reader:
        for f in flats:
            for k, s in enumerate(f.slots):
                found = reader.find(names.get(id(s.param), [s.name])) if reader is not None else None
                if found is not None:
                    span = f.shard_range(k)
                    if span is not None:
                        f.write_shard(k, reader.read(found, span))
                elif id(s.param) in staged:
                    values = s.param.data
                    if values.is_floating_point() and bool(values.isnan().any()):
                        raise RuntimeError(_unwritten(s.name))
                    f.write_shard(k, values)
                else:
                    raise RuntimeError(_unwritten(s.name))
                staged.pop(id(s.param), None)
                done.add(id(s.param))
            f.view_params()
            f.end_deferred()


def _unwritten(name: str) -> str:
    module = name.rpartition(".")[0] or "<root>"
    return (f"Deferred initialisation: parameter {name!r} of module {module!r} was built on the meta device and no"
            " initialisation wrote it (the module has no reset_parameters(), and no Hugging Face _init_weights hook"
            " covers it). Give the module a reset_parameters() that initialises its own tensors, build it outside"
            " the meta device, or load pretrained weights that hold it.")


def _buffers_to(module: nn.Module, device: torch.device, source: WeightsSource | None) -> None:
    """Move the buffers initialised on CPU to ``device`` (from ``source`` where it holds them); a buffer still on
    the meta device (no call wrote it) is an error naming its module."""
    reader_cm = source.open() if source is not None else contextlib.nullcontext()
    with reader_cm as reader:
        for mname, m in module.named_modules():
            for bname, b in list(m._buffers.items()):
                if b is None:
                    continue
                qualified = f"{mname}.{bname}" if mname else bname
                found = reader.find([qualified]) if reader is not None and bname not in m._non_persistent_buffers_set \
                    else None
                if found is not None:
                    m._buffers[bname] = reader.read(found).to(device=device, dtype=b.dtype).reshape(b.shape)
                elif b.is_meta:
                    raise RuntimeError(
                        f"Deferred initialisation: buffer {qualified!r} of module {mname or '<root>'!r} was built on"
                        " the meta device and no initialisation wrote it. Give the module a reset_parameters() that"
                        " sets it, or build it outside the meta device.")
                elif b.device != device:
                    m._buffers[bname] = b.to(device)


def _rank0_rng_state(comm: Communicator) -> torch.Tensor:
    """Rank 0's CPU generator state (every rank must draw the same values)."""
    state = torch.get_rng_state()
    if torch.distributed.is_initialized() and comm.topology.world_size > 1:
        on_device = state.to(comm.device or "cpu")
        comm.broadcast(on_device, src=0)
        state = on_device.cpu()
    return state


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from (b for b in module.buffers() if b is not None)
