"""Sharded loading of pretrained full weights: each rank reads, one tensor at a time, only the slices of its own
shards, from a ``torch.save`` file (opened with ``mmap=True``), a safetensors file or a Hugging Face checkpoint
directory (``model.safetensors``, ``pytorch_model.bin`` or their sharded ``*.index.json`` forms).

Two ways in:

* :func:`init_from_pretrained` marks a model built on the meta device: when the strategy sets it up, each unit's
  values are read from the file instead of initialised (``deferred_init.py``), so no rank holds more than its shards
  and one unit: the Trainer flow for fine-tuning (call it in ``configure_model``; a checkpoint the Trainer resumes
  from is read after it and wins);
* :func:`load_pretrained` writes the weights into a model already sharded (the engine's parameter shards).

Files are opened per unit and closed after it, so pages a memory map brought in leave the resident set unit by unit.
Names: the module's parameter names, less ``prefix`` (a Hugging Face model held as ``self.model`` of a
LightningModule: ``prefix="model."``); a tied parameter is found under any of its names.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from lightning_paro.strategy.deferred_init import SOURCE_ATTR

PathLike = Union[str, Path]

_HF_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")
"""What a Hugging Face checkpoint directory holds, in the order it is looked for."""


class PretrainedWeights:
    """Full weights in one or more files, by name; :meth:`open` gives a reader for the span of one unit."""

    def __init__(self, path: PathLike, prefix: str = "") -> None:
        self.path = Path(path)
        self.prefix = prefix
        self.files = _files_of(self.path)
        """Name (as in the files) -> the file holding it."""

    @contextlib.contextmanager
    def open(self) -> Iterator[_Reader]:
        reader = _Reader(self)
        try:
            yield reader
        finally:
            reader.close()


class _Reader:
    """Reads tensors or slices of them from the files of :class:`PretrainedWeights`, opening each file once."""

    def __init__(self, weights: PretrainedWeights) -> None:
        self.weights = weights
        self._open: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()

    def find(self, names: list[str]) -> str | None:
        p = self.weights.prefix
        for name in names:
            if name.startswith(p) and name[len(p):] in self.weights.files:
                return name[len(p):]
        return None

    def read(self, name: str, span: tuple[int, int] | None = None) -> torch.Tensor:
        path = self.weights.files[name]
        if path.suffix == ".safetensors":
            return _safetensors_read(self._safetensors(path).get_slice(name), span)
        tensor = self._torch_file(path)[name]
        return tensor if span is None else tensor.reshape(-1)[span[0]:span[1]]

    def _safetensors(self, path: Path) -> Any:
        if path not in self._open:
            from safetensors import safe_open
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return self._open[path]

    def _torch_file(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._open:
            self._open[path] = _state_dict_of(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
        return self._open[path]

    def close(self) -> None:
        self._open.clear()  # the memory-mapped tensors go with their dict
        self._stack.close()


def _safetensors_read(tensor_slice: Any, span: tuple[int, int] | None) -> torch.Tensor:
    """The whole tensor, or the elements ``span`` of it flattened, reading only the rows that hold them."""
    shape = tensor_slice.get_shape()
    if span is None or len(shape) == 0:
        full = tensor_slice[:]
        return full if span is None else full.reshape(-1)[span[0]:span[1]]
    row = math.prod(shape[1:])
    first, last = span[0] // row, -(-span[1] // row)
    rows = tensor_slice[first:last].reshape(-1)
    return rows[span[0] - first * row:span[1] - first * row]


def _state_dict_of(loaded: Any) -> dict[str, torch.Tensor]:
    """A plain state dict, or the ``state_dict`` of a Lightning checkpoint."""
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(torch.is_tensor(v) for v in loaded.values()):
        raise ValueError("Pretrained weights must be a state dict (names to tensors), or a Lightning checkpoint that"
                         " holds one under 'state_dict'.")
    return loaded


def _files_of(path: Path) -> dict[str, Path]:
    if path.is_dir():
        for name in _HF_FILES:
            if (path / name).exists():
                return _files_of(path / name)
        raise FileNotFoundError(f"{path} holds none of {', '.join(_HF_FILES)}: not a Hugging Face checkpoint.")
    if not path.exists():
        raise FileNotFoundError(f"No pretrained weights at {path}.")
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        return {name: path.parent / file for name, file in weight_map.items()}
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), path)
    names = _state_dict_of(torch.load(path, map_location="cpu", mmap=True, weights_only=True)).keys()
    return dict.fromkeys(names, path)


def init_from_pretrained(module: nn.Module, path: PathLike, prefix: str = "", strict: bool = True) -> None:
    """Have the strategy's set-up fill ``module`` (built on the meta device) from the full weights at ``path``, unit by
    unit and each rank only its shards, instead of initialising it. Names are the module's less ``prefix``. With
    ``strict``, every parameter and persistent buffer must be in the weights (checked here, before set-up); without,
    the missing ones are initialised by the deferred-initialisation rule."""
    weights = PretrainedWeights(path, prefix)
    if strict:
        _check_covers(module, weights)
    setattr(module, SOURCE_ATTR, weights)


def load_pretrained(target: Any, path: PathLike, prefix: str = "", strict: bool = True) -> list[str]:
    """Write the full weights at ``path`` into the parameter shards of a sharded model: ``target`` is a
    ``PaROStrategy`` after set-up or a ``PaROEngine``. Each rank reads only its shards' slices, one tensor at a
    time; buffers are read whole. Returns the names not found (an error with ``strict``). Not a collective."""
    engine = getattr(target, "engine", target)
    if engine is None or not hasattr(engine, "flat_groups"):
        raise ValueError("load_pretrained needs a PaROStrategy that is set up (after trainer.fit/validate started) or"
                         " a PaROEngine.")
    weights = PretrainedWeights(path, prefix)
    module = engine.module
    if strict:
        _check_covers(module, weights)
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    missing = []
    engine.wait()
    for unit in engine.units:
        with weights.open() as reader:
            for f in unit.flats:
                for k, s in enumerate(f.slots):
                    found = reader.find(names[id(s.param)])
                    span = f.shard_range(k)
                    if found is None:
                        missing.append(s.name)
                    elif span is not None:
                        f.write_shard(k, reader.read(found, span))
    with weights.open() as reader:
        for mname, m in module.named_modules():
            for bname, b in m._buffers.items():
                if b is None or bname in m._non_persistent_buffers_set:
                    continue
                found = reader.find([f"{mname}.{bname}" if mname else bname])
                if found is not None:
                    with torch.no_grad():
                        b.copy_(reader.read(found).reshape(b.shape))
    engine.after_load()
    return missing


def _check_covers(module: nn.Module, weights: PretrainedWeights) -> None:
    """Refuse weights that miss a parameter or persistent buffer of ``module``, naming them."""
    with weights.open() as reader:
        missing = [name for name, names in _state_names(module).items() if reader.find(names) is None]
    if missing:
        raise KeyError(f"The pretrained weights at {weights.path} hold no tensor for {len(missing)} of the model's"
                       f" names (e.g. {missing[:3]}, looked up with prefix {weights.prefix!r} removed). Pass the"
                       " prefix the model's names have over the file's, or strict=False to initialise those.")


def _state_names(module: nn.Module) -> dict[str, list[str]]:
    """Per parameter (its first name) all its names; per persistent buffer its name."""
    out: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(first.setdefault(id(p), name), []).append(name)
    for mname, m in module.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = [f"{mname}.{bname}" if mname else bname]
    return out
