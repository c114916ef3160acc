"""What ``sharding="auto"`` measures of the running job itself.

- :func:`probe_update_bandwidth`: the optimizer update's memory bandwidth, from steps of the job's own optimizer class
  on a scratch buffer at start-up (every rank at once, as the real update runs).
- :class:`StepRecorder`: the compute time of a micro-step, the activation memory of one micro-batch and the time and
  traffic of an optimizer step, recorded on the first optimizer steps of ``fit`` under the strategy in use.

Every figure is this rank's; :func:`agree` makes them the same on every rank (collective).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from lightning_paro.planner.inputs import Workload


@dataclass(frozen=True)
class UpdateProbe:
    """The optimizer update's measured memory bandwidth."""

    bandwidth: float
    """Bytes per second in the cost model's terms: (2 K + b_g + b_p) bytes per trainable element updated."""
    seconds_per_element: float
    """Median time of one step over the scratch buffer, per element."""
    optimizer: str
    """The optimizer class that was timed."""
    elements: int
    """Elements in the scratch buffer."""

    def describe(self) -> str:
        return (f"update {self.bandwidth / 1e9:.3g} GB/s ({self.optimizer} stepped over {self.elements / 2**20:.3g}M"
                f" elements, {self.seconds_per_element * 1e9:.3g} ns each)")


def probe_update_bandwidth(optimizer: torch.optim.Optimizer | None, workload: Workload, device: torch.device,
                           elements: int = 2**22, repeats: int = 5) -> UpdateProbe:
    """Time the update of ``elements`` scratch elements by a fresh optimizer of ``optimizer``'s class and defaults (in
    the dtype the engine keeps optimizer shards in), the median of ``repeats`` steps after one that creates the states,
    and express it as the bandwidth the cost model divides the update's bytes by. An optimizer that cannot be built
    or stepped that way (one that needs a closure, or options of its own) is replaced by AdamW, named in the result.
    Not collective: call it on every rank at once, so the ranks of one machine share its memory bandwidth as they do
    in training."""
    dtype = workload.master_dtype
    scratch = torch.zeros(elements, dtype=dtype, device=device, requires_grad=True)
    scratch.grad = torch.full_like(scratch, 1e-3)
    candidates = [] if optimizer is None else [(type(optimizer), dict(optimizer.defaults))]
    candidates.append((torch.optim.AdamW, {"lr": 1e-3}))
    for cls, defaults in candidates:
        try:
            probe = cls([scratch], **defaults)
            probe.step()  # creates the states
        except Exception:  # noqa: BLE001  (any optimizer the probe cannot drive: fall back to AdamW)
            continue
        times = []
        for _ in range(repeats):
            _synchronize(device)
            started = time.perf_counter()
            probe.step()
            _synchronize(device)
            times.append(time.perf_counter() - started)
        per_element = max(statistics.median(times), 1e-9) / elements
        charged = 2 * workload.optim_bytes + workload.grad_bytes + workload.param_bytes
        return UpdateProbe(charged / per_element, per_element, cls.__name__, elements)
    raise RuntimeError("The update probe could not step AdamW on a scratch buffer.")  # pragma: no cover


def update_key(optimizer: torch.optim.Optimizer | None, workload: Workload) -> str:
    """What an update bandwidth measured by :func:`probe_update_bandwidth` depends on besides the hosts: the
    optimizer class, the dtype of its shards and its ``foreach``/``fused`` choices (a link cache keeps the figure
    under this name)."""
    dtype = str(workload.master_dtype).removeprefix("torch.")
    if optimizer is None:
        return f"AdamW {dtype}"
    defaults = optimizer.defaults
    return (f"{type(optimizer).__name__} {dtype} foreach={defaults.get('foreach')} fused={defaults.get('fused')}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class JobFigures:
    """What the first optimizer steps of a job measured (one rank's, or agreed over the ranks by :func:`agree`)."""

    micro_step_seconds: float
    """Compute time of one micro-step (forward and backward, the time spent waiting for collectives left out)."""
    activation_bytes: float
    """Bytes autograd saved for backward in one micro-batch's forward, parameters left out (the largest micro-batch)."""
    step_seconds: float
    """Wall time of one optimizer step under the strategy in use (median)."""
    intra_bytes: float
    """Bytes this rank sent inside its group per optimizer step (mean)."""
    inter_bytes: float
    """Bytes this rank sent to other groups per optimizer step (mean)."""
    steps: int
    """Optimizer steps measured."""

    def describe(self) -> str:
        return (f"compute {self.micro_step_seconds * 1e3:.4g} ms per micro-step, activations"
                f" {self.activation_bytes / 1e6:.4g} MB per micro-batch, {self.step_seconds:.4g} s per optimizer step"
                f" ({self.steps} steps measured)")


class StepRecorder:
    """Records the first optimizer steps of ``fit``: the strategy calls :meth:`forward` around each micro-step's
    forward, :meth:`end_backward` after its backward and :meth:`end_step` after each optimizer step.

    The first ``skip`` steps are not timed (they allocate buffers, build autograd's graph caches and run the first
    gathers); activations are counted from the first micro-step on (:attr:`activation_bytes`), so a plan that does
    not fit them can be corrected after the first step. A micro-step's compute time is the training thread's CPU
    time where compute runs on that thread alone (CPU with one intra-op thread: waiting for a collective costs no
    CPU time, and time taken by other processes on the same cores is not counted, as the cost model's overlap
    expects); elsewhere it is wall time less the time spent waiting for collectives (``waited``), with the device
    synchronized at both ends.

    Args:
        steps: optimizer steps to measure.
        device: the compute device.
        waited: seconds this rank has spent waiting for collectives so far (the communicator's counter).
        traffic: bytes this rank has sent so far, ``(intra, inter)``.
        excluded_storages: data pointers of storages that are not activations (the engine's parameter buffers).
        skip: optimizer steps to leave out first.
    """

    def __init__(self, steps: int, device: torch.device, waited: Callable[[], float],
                 traffic: Callable[[], tuple[float, float]], excluded_storages: Callable[[], set[int]],
                 skip: int = 1) -> None:
        self.steps = steps
        self.device = device
        self._waited = waited
        self._traffic = traffic
        self._excluded = excluded_storages
        self._skip = skip
        self._step = 0
        self._cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1
        self._micro_start: tuple[float, float] | None = None
        self._micro: list[float] = []
        self._activations: list[int] = []
        self._step_times: list[float] = []
        self._step_traffic: list[tuple[float, float]] = []
        self._last_step_end = (time.perf_counter(), traffic())

    @property
    def measuring(self) -> bool:
        """Whether the current optimizer step is one that is measured."""
        return self._skip <= self._step < self._skip + self.steps

    @property
    def done(self) -> bool:
        """Whether every step to measure has been."""
        return self._step >= self._skip + self.steps

    @property
    def activation_bytes(self) -> int:
        """The most bytes one micro-batch's forward saved for backward so far (parameters left out)."""
        return max(self._activations, default=0)

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Around a micro-step's forward: starts its clock (on a measured step) and counts the bytes autograd saves for
        backward."""
        if self.done:
            yield
            return
        if self.measuring:
            self._micro_start = self._clock()
        excluded = self._excluded()
        seen: set[int] = set()
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
                return t
            base = t._base if t._base is not None else t
            if isinstance(base, torch.nn.Parameter):  # a weight saved for backward: a parameter, not an activation
                return t
            if ptr not in seen and ptr not in excluded:
                seen.add(ptr)
                saved += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._activations.append(saved)

    def end_backward(self) -> None:
        """After a micro-step's backward: its compute time is recorded."""
        if self._micro_start is None:
            return
        start_clock, start_waited = self._micro_start
        end_clock, end_waited = self._clock()
        self._micro_start = None
        self._micro.append(max(0.0, (end_clock - start_clock) - (end_waited - start_waited)))

    def end_step(self) -> None:
        """After an optimizer step."""
        now, sent = time.perf_counter(), self._traffic()
        if self.measuring:
            before_time, before_sent = self._last_step_end
            self._step_times.append(now - before_time)
            self._step_traffic.append((sent[0] - before_sent[0], sent[1] - before_sent[1]))
        self._last_step_end = (now, sent)
        self._step += 1

    def figures(self) -> JobFigures:
        """This rank's figures (once :attr:`done`)."""
        if not self._micro or not self._step_times:
            raise RuntimeError("StepRecorder.figures(): no micro-step was measured.")
        return JobFigures(
            micro_step_seconds=statistics.fmean(self._micro),
            activation_bytes=float(self.activation_bytes),
            step_seconds=statistics.median(self._step_times),
            intra_bytes=statistics.fmean(t[0] for t in self._step_traffic),
            inter_bytes=statistics.fmean(t[1] for t in self._step_traffic),
            steps=len(self._step_times),
        )

    def _clock(self) -> tuple[float, float]:
        """(clock, waited): the thread's CPU time and 0, or wall time and the seconds waited for collectives."""
        if self._cpu_clock:
            return time.thread_time(), 0.0
        _synchronize(self.device)
        return time.perf_counter(), self._waited()


def agree(figures: JobFigures, group=None, device=None) -> JobFigures:
    """Collective: the figures every rank plans with. Compute and traffic are the mean over the ranks (a step holds
    every rank's micro-steps, and with more ranks than cores some wait for others' compute: the mean keeps what the
    ranks computed, not what they waited for); activation memory and step time the largest."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    mean = torch.tensor([figures.micro_step_seconds, figures.intra_bytes, figures.inter_bytes], dtype=torch.float64,
                        device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.SUM, group=group)
    most = torch.tensor([figures.activation_bytes, figures.step_seconds], dtype=torch.float64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    compute, intra, inter = (mean / n).tolist()
    activations, step = most.tolist()
    return JobFigures(compute, activations, step, intra, inter, figures.steps)
