"""``Trainer(strategy="paro")``: the Lightning-facing PaRO strategy. Thin hooks over plain functions: the sharding
lives in the engine (``engine.py``, built for the strategy in ``engine_setup.py``), saving and loading checkpoints
in ``checkpoint.py``, the options' defaults and checks in ``options.py``, the process groups and Lightning's
collectives in ``distributed.py``, each evaluation stage in full or sharded in ``evaluation_stage.py``, the module
handed back at teardown in ``teardown.py``, the per-step traffic record in ``traffic.py`` and ``sharding="auto"`` in
``auto_session.py``."""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_paro.comm.accounting import TrafficMeter
from lightning_paro.comm.collectives import HOR_EXACT_SCOPES, Communicator, comm_thread, run_on_comm_thread
from lightning_paro.comm.ho_ring import HORingConfig
from lightning_paro.comm.topology import Topology
from lightning_paro.planner import AutoConfig, Plan, agreed_minimum, device_memory_bytes
from lightning_paro.planner.replan import Switch
from lightning_paro.strategy.auto_session import AutoSession
from lightning_paro.strategy import checkpoint as ckpt
from lightning_paro.strategy.deferred_init import move_materialised
from lightning_paro.strategy.distributed import (
    all_reduce,
    barrier,
    broadcast_object,
    default_process_group_backend,
    init_default_group,
    same_layout,
)
from lightning_paro.strategy.engine import PaROEngine, show_module_params
from lightning_paro.strategy.engine_setup import ho_ring_config, new_engine, retire, unwrap, warn_untracked
from lightning_paro.strategy.evaluation_stage import begin_stage, gather_in_full, is_last_batch, run_step
from lightning_paro.strategy.levels import VALID_STRATEGIES, ShardingSpec
from lightning_paro.strategy.manual import ManualSteps, check_one_optimizer
from lightning_paro.strategy.options import GatherConfig, GatherMode, PaROOptions
from lightning_paro.strategy.precision import to_paro_precision
from lightning_paro.strategy.read_guard import drop_sharded_read_guard, guard_sharded_reads
from lightning_paro.strategy.reshard import reshard
from lightning_paro.strategy.report import StepTraffic, format_summary
from lightning_paro.strategy.state_dicts import load_full_model_state, load_full_optimizer_state
from lightning_paro.strategy.teardown import hand_back, teardown_after_failure, teardown_sharded
from lightning_paro.strategy.traffic import log_step, sent, step_since
from lightning_paro.strategy.units import UnitPolicy

log = logging.getLogger(__name__)

_DEFAULT = PaROOptions()


class PaROStrategy(ParallelStrategy):
    """PaRO-DP: parameters, gradients and optimizer states each unsharded (N), sharded in the node group (I) or
    sharded globally (G).

    The PaRO arguments are the fields of :class:`~lightning_paro.strategy.options.PaROOptions`, which documents each
    one, holds its default and validates it (an :class:`~lightning_paro.strategy.options.OptionError`, a
    ``ValueError``, names the option and the fix). In short: ``sharding`` (``"IIG"``, one of the 14 strategies, or
    ``"auto"`` to measure the links and memory at set-up and take the fastest that fits; the candidate table is
    kept in ``auto_plan``), ``group_size`` (ranks per group; the processes per node), ``units``, ``prefetch``,
    ``chunk_bytes``, ``log_traffic``, ``auto`` (an :class:`~lightning_paro.planner.AutoConfig`),
    ``state_dict_type`` (``"sharded"`` directories any layout can read, or ``"full"`` files), ``gather`` (whether
    evaluation and the module after fit hold the whole model), ``param_dtype`` and ``reduce_dtype`` (the dtypes
    parameters are gathered and gradients reduced in during training, as FSDP2's ``MixedPrecisionPolicy``: "bf16"
    halves those bytes), ``inter_quant`` ("int8": block-quantized traffic between groups) and ``error_feedback``,
    ``start_method``, ``process_group_backend`` and
    ``timeout`` (when a collective fails or stalls that long, every surviving rank raises
    :class:`~lightning_paro.comm.collectives.CollectiveError` naming the operation and scope). The others are
    Lightning's.
    """

    strategy_name = "paro"

    def __init__(
        self,
        sharding: Union[str, ShardingSpec] = _DEFAULT.sharding,
        group_size: Optional[int] = _DEFAULT.group_size,
        units: UnitPolicy = _DEFAULT.units,
        prefetch: int = _DEFAULT.prefetch,
        chunk_bytes: Optional[int] = _DEFAULT.chunk_bytes,
        log_traffic: bool = _DEFAULT.log_traffic,
        auto: Optional[AutoConfig] = _DEFAULT.auto,
        state_dict_type: Literal["sharded", "full"] = _DEFAULT.state_dict_type,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = _DEFAULT.process_group_backend,
        timeout: Optional[timedelta] = _DEFAULT.timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = _DEFAULT.start_method,
        gather: Union[GatherMode, GatherConfig] = _DEFAULT.gather,
        param_dtype: Union[str, torch.dtype, None] = _DEFAULT.param_dtype,
        reduce_dtype: Union[str, torch.dtype, None] = _DEFAULT.reduce_dtype,
        inter_quant: Optional[str] = _DEFAULT.inter_quant,
        error_feedback: bool = _DEFAULT.error_feedback,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.options = PaROOptions(sharding=sharding, group_size=group_size, units=units, prefetch=prefetch,
                                   chunk_bytes=chunk_bytes, log_traffic=log_traffic, auto=auto,
                                   state_dict_type=state_dict_type, gather=gather, start_method=start_method,
                                   process_group_backend=process_group_backend, timeout=timeout,
                                   param_dtype=param_dtype, reduce_dtype=reduce_dtype, inter_quant=inter_quant,
                                   error_feedback=error_feedback)
        """The options as given (validated)."""
        self.sharding: Optional[ShardingSpec] = self.options.spec
        """The strategy in use (chosen at set-up when ``sharding="auto"``)."""
        self._auto_session: Optional[AutoSession] = (AutoSession(self.options.auto_config)
                                                      if self.options.is_auto else None)
        self.gather = self.options.gather_config
        self._group_size = group_size
        self._chunk_bytes = chunk_bytes
        self.state_dict_type = state_dict_type
        self._restored_sharded = False
        self._units = units
        self._prefetch = prefetch
        self._log_traffic = log_traffic
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._topology: Optional[Topology] = None
        self._comm: Optional[Communicator] = None
        self.meter = TrafficMeter()
        """Bytes sent by this rank, by collective and scope, since the strategy was set up."""
        self.engine: Optional[PaROEngine] = None
        """The sharding engine (set up in ``setup``)."""
        self.traffic_history: list[StepTraffic] = []
        """Per optimizer step: bytes this rank sent, by scope."""
        self._last_snapshot: dict = {}
        self._sync_grads = True
        self._manual: Optional[ManualSteps] = None
        """Under manual optimization: when the gradients reach the optimizer shards."""
        self._failed = False

    # ------------------------------------------------------------------ properties
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def group_size(self) -> int:
        """m: ranks per group (the processes per node unless given)."""
        return self._group_size or self.num_processes or 1

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("The PaRO topology exists once the processes are set up.")
        return self._topology

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = to_paro_precision(precision_plugin) if precision_plugin is not None else None

    # ------------------------------------------------------------------ launch and set-up
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Fail before any process is started when the layout cannot work.
        if self.num_processes:
            Topology(world_size=self.num_nodes * self.num_processes, group_size=self.group_size, rank=0)
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        if self._process_group_backend is None:  # an explicit backend is kept as given
            self._process_group_backend = default_process_group_backend(self.root_device)
        init_default_group(self.cluster_environment, self._process_group_backend, self.root_device, self._timeout)
        topo = Topology(world_size=self.world_size, group_size=self.group_size, rank=self.global_rank)
        if not same_layout(self._topology, topo):
            self._topology, self._comm = topo, None

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        drop_sharded_read_guard(self.lightning_module)  # whichever strategy left it: this one takes the module over
        show_module_params(self.lightning_module)  # parameters left showing local pieces: the full views again
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            check_one_optimizer(self.optimizers)
        if self._auto_session is not None and (self.auto_plan is None or fitting):
            self._plan_sharding(trainer, fitting)
        assert self.lightning_module is not None
        if fitting or self.engine is None or not self.engine.holds(self.lightning_module):
            self._build_engine(self.optimizers if fitting else [])
        else:
            # validate / test / predict after fit: keep the engine and with it the fit's optimizer shards, which
            # `trainer.save_checkpoint` saves afterwards (as "ddp" keeps its optimizers).
            self.engine.adopt_module_values()
        assert self.engine is not None
        self._manual = ManualSteps(self.engine) if fitting and not self.lightning_module.automatic_optimization \
            else None
        if fitting and self._auto_session is not None:
            comm, meter = self._comm, self.meter
            assert comm is not None and self.sharding is not None
            self._auto_session.start_fit(self.sharding.name, self.root_device, waited=lambda: comm.waited_seconds,
                                         traffic=lambda: sent(meter), module=self.lightning_module,
                                         group=self.topology.groups.world, prefetch=self._prefetch,
                                         manual=self._manual is not None,
                                         steps_left=lambda: _steps_left(trainer),
                                         record_dir=trainer.log_dir if trainer.loggers else None)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _plan_sharding(self, trainer: "pl.Trainer", fitting: bool) -> None:
        """``sharding="auto"``: probe the links and memory, run the cost model, take the fastest strategy that fits
        (collective: every rank measures, all agree)."""
        raw = [unwrap(o) for o in self.optimizers] if fitting else []
        assert self.lightning_module is not None and self._auto_session is not None
        name = self._auto_session.plan_at_setup(
            self.lightning_module, raw, self.topology, self.root_device,
            accumulation=trainer.accumulate_grad_batches if fitting else 1, ranks_on_host=self.num_processes,
            units=self._units, prefetch=self._prefetch, chunk_bytes=self._chunk_bytes, comm=self.options.comm_dtypes,
            broadcast=self.broadcast)
        self.sharding = ShardingSpec.parse(name)

    def _switch_strategy(self, name: str) -> None:
        """Reshard the model and optimizer states in memory to the levels of ``name`` (collective)."""
        assert self.engine is not None
        self.sharding = ShardingSpec.parse(name)
        # The module's parameters come back the same on every rank: the new engine need not broadcast them.
        self.engine = reshard(self.engine, lambda optimizers: self._new_engine(optimizers, replicated=True))
        self._attach_engine()

    # ``sharding="auto"``'s record (strategy/auto_session.py)
    @property
    def auto_plan(self) -> Optional[Plan]:
        """With ``sharding="auto"``: the candidate table, the choice and every figure it used (the latest plan: the
        re-plan's once made)."""
        return self._auto_session.plan if self._auto_session is not None else None

    @auto_plan.setter
    def auto_plan(self, plan: Optional[Plan]) -> None:
        if self._auto_session is None:
            raise ValueError("auto_plan belongs to sharding='auto'.")
        self._auto_session.plan = plan

    @property
    def auto_switches(self) -> list[Switch]:
        """With ``sharding="auto"``: the strategy switches made in place during fit (step, strategies, reason, cost)."""
        return self._auto_session.switches if self._auto_session is not None else []

    @property
    def auto_replans(self) -> list[dict[str, Any]]:
        """With ``sharding="auto"``: each re-plan (step, strategy in use, measured and predicted step time, decision)."""
        return self._auto_session.replans if self._auto_session is not None else []

    @property
    def auto_plan_seconds(self) -> float:
        """With ``sharding="auto"``: seconds the start-up plan took (probes and planning)."""
        return self._auto_session.plan_seconds if self._auto_session is not None else 0.0

    def _build_engine(self, optimizers: list[Optimizer]) -> None:
        if self.engine is not None:  # configure_model / setup run again: start from the plain module
            retire(self.engine, self._comm)
            self.engine, self._comm = None, None
        if self._comm is None:
            self._comm = Communicator(self.topology, self.meter, device=self.root_device,
                                      ho_ring_config=self._ho_ring_config())
        self.engine = self._new_engine([unwrap(o) for o in optimizers])
        self._attach_engine()
        warn_untracked(self.engine)
        self._last_snapshot = self.meter.snapshot()

    def _new_engine(self, optimizers: list[Optimizer], replicated: bool = False) -> PaROEngine:
        """An engine of the strategy in use over the module and ``optimizers`` (raw torch optimizers)."""
        assert self.lightning_module is not None and self._comm is not None and self.sharding is not None
        return new_engine(self.lightning_module, self.sharding, self._comm, optimizers,
                          precision=self.precision_plugin.precision, units=self._units, prefetch=self._prefetch,
                          comm_dtypes=self.options.comm_dtypes, replicated=replicated)

    def _attach_engine(self) -> None:
        """Point the precision plugin's gradient clipping at the engine in use."""
        self.precision_plugin.paro_engine = self.engine
        self.precision_plugin.paro_sync_grads = self._before_clip

    def _ho_ring_config(self) -> HORingConfig:
        """The HO-Ring settings: the ``chunk_bytes`` given, else the chunk ``sharding="auto"`` planned with, else the
        default."""
        return ho_ring_config(HOR_EXACT_SCOPES, self._chunk_bytes, self.auto_plan)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        move_materialised(self.model, self.root_device)  # meta tensors get their values, there, when sharded

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``empty_init=True`` (``trainer.init_module(empty_init=True)``): build on the meta device; set-up gives the
        model its values one unit at a time, straight into each rank's shards (``deferred_init.py``)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ training hooks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None
        self.engine.pre_step()
        if self._auto_session is None:
            return super().training_step(*args, **kwargs)
        with self._auto_session.forward():
            return super().training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._manual is not None:
            self._manual.before_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        assert self.engine is not None
        if self._manual is not None:
            self._manual.after_backward()
        else:
            self.engine.finish_backward(sync=self._sync_grads)
        if self._auto_session is not None:
            self._auto_session.end_backward()

    def _before_clip(self) -> None:
        if self._manual is not None:
            self._manual.before_step()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-steps inside this context accumulate gradients without the once-per-step gradient sync."""
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = True

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None, **kwargs: Any) -> Any:
        if self._manual is not None:
            self._manual.before_step()
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.engine is not None
        self.engine.after_optimizer_step(unwrap(optimizer))
        if self._manual is not None:
            self._manual.after_step()
        self._record_step_traffic()
        if self._auto_session is not None:  # the step just made is not counted in global_step yet
            self._auto_session.after_step(self.lightning_module.trainer.global_step + 1, self._switch_strategy,
                                          settle=self.engine.wait,
                                          engine=self.engine)
        return out

    def _record_step_traffic(self) -> None:
        step, self._last_snapshot = step_since(self.meter, self._last_snapshot)
        self.traffic_history.append(step)
        if self._log_traffic:
            log_step(self.lightning_module, step)

    # ------------------------------------------------------------------ evaluation: gathered in full, or sharded
    @override
    def on_validation_start(self) -> None:
        self._begin_eval("validate")

    @override
    def on_validation_end(self) -> None:
        self._end_eval()

    @override
    def on_test_start(self) -> None:
        self._begin_eval("test")

    @override
    def on_test_end(self) -> None:
        self._end_eval()

    @override
    def on_predict_start(self) -> None:
        self._begin_eval("predict")

    @override
    def on_predict_end(self) -> None:
        self._end_eval()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().predict_step, *args, **kwargs)

    def _begin_eval(self, stage: str) -> None:
        if self.engine is not None:
            begin_stage(self.engine, lambda: self._gather_in_full(self.gather.evaluation), self.lightning_module,
                        stage)

    def _end_eval(self) -> None:
        if self.engine is not None:
            self.engine.end_eval()

    def _eval_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return run_step(self.engine, step, lambda: is_last_batch(self.lightning_module), *args, **kwargs)

    def _gather_in_full(self, mode: GatherMode) -> bool:
        """Collective under "auto": every rank takes the same decision, from the smallest free memory."""
        assert self.engine is not None
        return gather_in_full(mode, self.engine.root.sharded_params, self.engine.full_param_bytes,
                              self.gather.memory_fraction, self._agreed_free_bytes)

    def _agreed_free_bytes(self) -> float:
        """The smallest free device memory over the ranks (collective); unbounded where it cannot be read."""
        try:
            free: float = device_memory_bytes(self.root_device, ranks_on_host=self.num_processes)
        except (ValueError, RuntimeError):  # a device whose free memory cannot be read: gather in full, as before
            free = float("inf")
        if _distributed_is_initialized():
            free = self._on_comm_thread(lambda: agreed_minimum(free, device=self.root_device), "gather decision")
        return free

    def export_full_state_dict(self, path: Union[str, Path]) -> None:
        """Write the module's full state dict (``torch.save``) to ``path`` from rank 0, gathering one unit at a time
        onto rank 0's CPU: for a model whose parameters do not fit one rank's device at once (collective)."""
        assert self.engine is not None, "export_full_state_dict needs the strategy set up (after fit or a stage)"
        with self.engine.params_shown():
            ckpt.export_full(self, self.engine, path)

    # ------------------------------------------------------------------ checkpoints (strategy/checkpoint.py)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints are read into the engine's shards

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self._restored_sharded  # a sharded checkpoint's optimizer states are read in load_checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: this rank's chunks of every tensor. Full: the whole state dict (collective; rank 0 saves it)."""
        assert self.lightning_module is not None
        if self.engine is None:
            return self.lightning_module.state_dict()
        with self.engine.params_shown():  # also between stages, with the module left sharded
            self.engine.exact_params()  # the weights, not the copy rounded for the wire (param_dtype)
            return ckpt.module_state_to_save(self.engine, sharded=self.state_dict_type == "sharded")

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.engine is not None
        with self.engine.params_shown():
            return ckpt.optimizer_state_to_save(self.engine, unwrap(optimizer),
                                                sharded=self.state_dict_type == "sharded")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Written aside, then published atomically (:func:`~lightning_paro.strategy.checkpoint.save`)."""
        if storage_options is not None:
            raise TypeError("PaROStrategy.save_checkpoint does not take storage_options.")
        ckpt.save(self, checkpoint, filepath, sharded=self.state_dict_type == "sharded",
                  write_file=self.checkpoint_io.save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.engine is not None and self.lightning_module is not None
        self.engine.wait()
        weights_only = True if weights_only is None else weights_only  # opt out explicitly for trusted files
        if not path.is_dir():
            self._restored_sharded = False
            return super().load_checkpoint(path, weights_only=weights_only)
        module = self.lightning_module
        fitting = module._trainer is not None and module._trainer.state.fn == TrainerFn.FITTING
        meta = ckpt.load_sharded(self.engine, path, strict=module.strict_loading, fitting=fitting,
                                 weights_only=weights_only)
        self._restored_sharded = True
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._restored_sharded or self.engine is None:
            return  # a sharded checkpoint was read in place by load_checkpoint
        load_full_model_state(self.engine, checkpoint["state_dict"], strict=strict)
        self.engine.after_load()

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._restored_sharded or self.engine is None:
            return
        for i, sd in enumerate(checkpoint["optimizer_states"]):
            load_full_optimizer_state(self.engine, i, sd)

    def memory_report(self) -> dict[str, int]:
        """Per-rank bytes of parameters, gradients and optimizer states held by the engine."""
        return self.engine.memory_report() if self.engine is not None else {}

    def summary(self) -> str:
        """A printable report: strategy, topology, per-step traffic by scope and per-rank model-state memory."""
        if self.sharding is None:
            return "PaRO strategy: 'auto', not chosen yet (the choice is made at set-up)"
        return format_summary(self.sharding, self._topology, self.traffic_history, self.memory_report(),
                              self.engine.num_params() if self.engine is not None else {})

    # ------------------------------------------------------------------ collectives for Lightning
    # Each runs on the engine's communication thread, after the collectives issued before it: it never runs beside
    # them (which NCCL needs), and a failure raises CollectiveError ("PaRO strategy.barrier over scope 'global'
    # failed: ...") within the process group's timeout instead of hanging.
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        self._on_comm_thread(lambda: barrier(self.root_device), "strategy.barrier")

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        return self._on_comm_thread(lambda: broadcast_object(obj, src), "strategy.broadcast")

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        return self._on_comm_thread(lambda: all_reduce(tensor, group, reduce_op), "strategy.reduce")

    def _on_comm_thread(self, fn: Callable[[], Any], what: str) -> Any:
        if self._topology is None:  # before set-up: no engine, so nothing to run beside
            return fn()
        return run_on_comm_thread(comm_thread(self._topology, self.root_device), fn, what)

    # ------------------------------------------------------------------ pickling (spawn start methods)
    @override
    def __getstate__(self) -> dict:
        # Threads, locks and process groups live in one process: the spawned workers build their own.
        state = super().__getstate__()
        for key in ("_topology", "_comm", "engine"):
            state[key] = None
        state["meter"] = None
        return state

    @override
    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.meter = TrafficMeter()

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning tears down next; the failure may be a collective, or peers may be inside one that will not end.
        self._failed = True

    @override
    def teardown(self) -> None:
        failed, self._failed = self._failed, False
        if failed:
            teardown_after_failure(self)
        elif self.engine is not None and not self._hand_back():
            teardown_sharded(self)
            guard_sharded_reads(self.lightning_module)
        else:
            super().teardown()

    def _hand_back(self) -> bool:
        """The module gathered when it fits (``gather.after_fit``), else left sharded: whether it is whole."""
        assert self.engine is not None
        return hand_back(self.engine, lambda: self._gather_in_full(self.gather.after_fit))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("paro", cls, description="PaRO-DP sharding, strategy chosen automatically")
        for name in VALID_STRATEGIES:
            strategy_registry.register(f"paro_{name.lower()}", cls, description=f"PaRO-DP strategy {name}",
                                       sharding=name)


def _steps_left(trainer: "pl.Trainer") -> float:
    """Optimizer steps the fit has left after the one being made (called from its step hook, before ``global_step``
    counts it); infinite when the trainer cannot tell."""
    try:
        return float(trainer.estimated_stepping_batches) - (trainer.global_step + 1)
    except Exception:  # noqa: BLE001  (no length to estimate from: as many as needed)
        return math.inf
