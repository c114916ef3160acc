"""Differences between the torch and Lightning versions the package supports, in one place.

Code elsewhere calls these names (as ``compat.NAME``, so a test can patch them) and never tests versions itself.

The package also relies on a few private (underscore) or undocumented APIs of torch, Lightning and Hydra, which a release
may rename without notice. They are listed in :data:`PRIVATE_APIS`, each with a probe; :func:`check_private_apis`
fails with one message naming every one the installed versions lack, where the package uses it, and the versions
it was tested with. ``python -m lightning_paro.compat`` prints the table (``__main__.py``: a package, so that running
it after the package's own import of this module is not a second copy of it, which Python warns about).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

TESTED_VERSIONS = {"torch": "2.13", "lightning": "2.6", "hydra-core": "1.3"}
"""The releases the test suite runs on (pyproject.toml's lower bounds)."""


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


# ---------------------------------------------------------------------------------------------------- private APIs
class IncompatibleVersionError(ImportError):
    """The installed torch or Lightning lacks an API this package relies on."""


@dataclass(frozen=True)
class PrivateAPI:
    """One private or undocumented API the package relies on."""

    name: str
    """The API, as the package uses it."""
    area: str
    """Which part of the package breaks without it: predict, strategy or checkpoint."""
    used_by: str
    """Where and why the package uses it."""
    probe: Callable[[], bool]
    """True when the installed version has it (never raises)."""


def _attr(module: str, *path: str) -> Callable[[], bool]:
    def probe() -> bool:
        obj: Any = importlib.import_module(module)
        for name in path:
            obj = getattr(obj, name)
        return True

    return probe


def _source_mentions(module: str, qualname: str, *needles: str) -> Callable[[], bool]:
    """The function or class ``module.qualname`` exists and its source mentions every needle (for protocols and
    attributes that exist only at run time)."""

    def probe() -> bool:
        obj: Any = importlib.import_module(module)
        for name in qualname.split("."):
            obj = getattr(obj, name)
        text = inspect.getsource(obj)
        return all(needle in text for needle in needles)

    return probe


def _predict_loop_data_source() -> bool:
    from lightning.pytorch.loops.prediction_loop import _PredictionLoop

    source = _PredictionLoop(trainer=None)._data_source
    return hasattr(source, "instance") and callable(getattr(source, "dataloader", None))


def _dataloader_in_order() -> bool:
    return "in_order" in inspect.signature(torch.utils.data.DataLoader).parameters


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI("lightning.pytorch.loops.prediction_loop._PredictionLoop._data_source (.instance, .dataloader())",
               "predict", "ElasticPredict.setup: takes the DataLoader given to trainer.predict and puts the shard-leasing"
               " one in its place before the loop iterates it", _predict_loop_data_source),
    PrivateAPI("torch.utils.data.DataLoader(in_order=...)", "predict",
               "predict/loader.py: the leased batches must reach the writer in the order the sampler leased them"
               " (public since torch 2.6)", _dataloader_in_order),
    PrivateAPI("lightning.pytorch.strategies.launchers._SubprocessScriptLauncher", "strategy",
               "PaROStrategy(start_method='popen'): Lightning's subprocess launcher",
               _attr("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher")),
    PrivateAPI("lightning.pytorch.strategies.launchers._MultiProcessingLauncher", "strategy",
               "PaROStrategy(start_method='spawn'|'fork'|'forkserver')",
               _attr("lightning.pytorch.strategies.launchers", "_MultiProcessingLauncher")),
    PrivateAPI("lightning.fabric.utilities.optimizer._optimizers_to_device", "strategy",
               "PaROStrategy.setup: moves optimizer states to the rank's device, as Lightning's own strategies do",
               _attr("lightning.fabric.utilities.optimizer", "_optimizers_to_device")),
    PrivateAPI("lightning.pytorch.core.optimizer.LightningOptimizer._optimizer", "strategy",
               "PaROStrategy: the torch optimizer inside Lightning's wrapper, whose param groups hold the shards",
               _source_mentions("lightning.pytorch.core.optimizer", "LightningOptimizer.__init__", "self._optimizer")),
    PrivateAPI("torch.distributed.checkpoint tensor protocol (__create_write_items__, __create_chunk_list__,"
               " __get_tensor_shard__)", "checkpoint",
               "strategy/flat_chunks.py FlatChunks: each rank saves its slices of the flat buffers under the tensors'"
               " own names and shapes",
               lambda: (_source_mentions("torch.distributed.checkpoint.planner_helpers", "_create_write_items",
                                         "__create_write_items__")()
                        and _source_mentions("torch.distributed.checkpoint.planner_helpers", "_create_chunk_list",
                                             "__create_chunk_list__")()
                        and "__get_tensor_shard__" in inspect.getsource(
                            importlib.import_module("torch.distributed.checkpoint.utils")))),
    PrivateAPI("torch.distributed.checkpoint.DefaultLoadPlanner.set_up_planner (sets state_dict, mappings,"
               " flatten_state_dict)", "checkpoint",
               "strategy/flat_chunks.py ChunkLoadPlanner: hides its chunk objects from the default set-up and puts"
               " them back under the flattened keys",
               _source_mentions("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner.set_up_planner",
                                "self.state_dict", "self.mappings")),
    PrivateAPI("lightning.pytorch.Trainer._active_loop (.batch_progress.is_last_batch)", "strategy",
               "PaROStrategy sharded evaluation: a rank joins its peers' gathers right after its last batch, which the"
               " loop knows one batch ahead (without it, at the end of the stage)",
               _attr("lightning.pytorch", "Trainer", "_active_loop")),
    PrivateAPI("torch.distributed ProcessGroup._get_backend(device).options._timeout", "strategy",
               "comm/group_cache.py default_timeout: the groups the package creates take the default group's timeout"
               " (torch would give them 30 minutes); without it they fall back to torch's default",
               _attr("torch.distributed", "ProcessGroup", "_get_backend")),
    PrivateAPI("hydra._internal.utils.get_args_parser", "cli",
               "cli/main.py: the command line is read by the parser @hydra.main uses (flags, -m, --cfg, -sc)",
               _attr("hydra._internal.utils", "get_args_parser")),
    PrivateAPI("hydra._internal.hydra.Hydra and hydra._internal.utils.create_config_search_path", "cli",
               "cli/main.py: shell completion over the package's config tree and the user's directories",
               lambda: _attr("hydra._internal.hydra", "Hydra")() and _attr("hydra._internal.utils",
                                                                          "create_config_search_path")()),
    PrivateAPI("hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments", "cli",
               "cli/sweep.py: a sweep's jobs are the combinations Hydra's basic sweeper makes of -m's overrides",
               _attr("hydra._internal.core_plugins.basic_sweeper", "BasicSweeper", "split_arguments")),
)
"""Every private or undocumented torch, Lightning and Hydra API the package uses."""


def missing_private_apis(areas: Optional[Sequence[str]] = None) -> list[PrivateAPI]:
    """The APIs of ``areas`` (all when None) the installed versions lack."""
    missing = []
    for api in PRIVATE_APIS:
        if areas is not None and api.area not in areas:
            continue
        try:
            present = bool(api.probe())
        except Exception:  # an import or attribute that is not there, a source that cannot be read
            present = False
        if not present:
            missing.append(api)
    return missing


def installed_versions() -> dict[str, str]:
    import hydra
    import lightning

    return {"torch": torch.__version__, "lightning": lightning.__version__, "hydra-core": hydra.__version__}


def check_private_apis(areas: Optional[Sequence[str]] = None) -> None:
    """Raises :class:`IncompatibleVersionError` naming every API of ``areas`` the installed versions lack."""
    missing = missing_private_apis(areas)
    if not missing:
        return
    versions = installed_versions()
    listed = "; ".join(f"{api.name} (used by {api.used_by})" for api in missing)
    installed = ", ".join(f"{k} {v}" for k, v in versions.items())
    tested = ", ".join(f"{k} {v}" for k, v in TESTED_VERSIONS.items())
    raise IncompatibleVersionError(
        f"{installed} lack what lightning-paro relies on: {listed}."
        f" Install the versions pyproject.toml asks for (tested with {tested})."
    )


def predict_data_source(trainer: Any) -> Any:
    """The source of the dataloaders given to ``trainer.predict`` (Lightning's private ``_data_source``)."""
    source = getattr(getattr(trainer, "predict_loop", None), "_data_source", None)
    if source is None or not hasattr(source, "instance"):
        check_private_apis(["predict"])
        raise IncompatibleVersionError("trainer.predict_loop._data_source is missing: see compat.PRIVATE_APIS")
    return source


def main() -> int:
    """``python -m lightning_paro.compat``: the private APIs and whether the installed versions have them."""
    versions = installed_versions()
    print(f"torch {versions['torch']}, lightning {versions['lightning']} (tested:"
          f" {', '.join(f'{k} {v}' for k, v in TESTED_VERSIONS.items())})")
    missing = {api.name for api in missing_private_apis()}
    for api in PRIVATE_APIS:
        print(f"  {'MISSING' if api.name in missing else 'ok':7s} [{api.area}] {api.name}")
    return 1 if missing else 0
