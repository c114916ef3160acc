"""The planner of ``sharding="auto"``: predict every PaRO strategy's step time and memory, choose the fastest that
fits.

It predicts the engine (``lightning_paro.strategy``) and imports nothing of it but the strategy names and the
design's volumes (and, to describe a job's model, its unit detection; ``job.py`` also reads the strategy's option
defaults from ``strategy.options``); the Lightning strategy calls
:func:`plan_for_job` under ``sharding="auto"``. One concern a file:

- ``inputs.py``: what the cost model is told (:class:`Link`, :class:`Cluster`, :class:`Workload`, :class:`Compute`).
- ``phases.py``: collectives as ring phases over one link class, and their alpha-beta time (HO-Ring pipelined).
- ``cost_model.py``: the engine's timeline, memory and traffic per strategy (:func:`predict`), the HO-Ring chunk.
- ``choose.py``: the candidate table and the fastest strategy within the memory budget (:func:`plan`, pure).
- ``report.py``: the plan as text (:func:`format_plan`) and the links and cluster in one line each; it reads
  ``choose.py``, never the other way (``sizes.py``: byte counts as text, for both).
- ``probe.py``: the start-up link probe (timed collectives, the alpha-beta fit, overlap with compute).
- ``link_cache.py``: the probe's figures (and the update bandwidth) kept for the next job on the same hosts, reused
  once the probe's large gathers, timed again, confirm them.
- ``memory.py``: the memory a rank may plan with, agreed on as the smallest over the ranks.
- ``workload.py``: a running job's module and optimizers as a :class:`Workload`.
- ``job.py``: :class:`AutoConfig` and :func:`plan_for_job`, what every rank of a job calls at start-up.

``python -m lightning_paro.plan`` runs :func:`plan` for given sizes, without training.
"""

from lightning_paro.planner.choose import DEFAULT_MEMORY_BUDGET, GB, Candidate, Plan, memory_budget_bytes, plan
from lightning_paro.planner.cost_model import (
    CHUNK_CHOICES,
    Memory,
    Prediction,
    StepTerms,
    fastest_chunk_bytes,
    predict,
    predict_all,
)
from lightning_paro.planner.inputs import GBIT, UNUSED_LINK, Cluster, Compute, Link, Workload
from lightning_paro.planner.job import AutoConfig, plan_for_job
from lightning_paro.planner.memory import agreed_minimum, available_host_memory, device_memory_bytes
from lightning_paro.planner.probe import MeasuredLinks, fit_link, large_gather_bytes, overlap_from_times, probe_links
from lightning_paro.planner.report import describe_cluster, describe_links, format_plan
from lightning_paro.planner.sizes import format_bytes
from lightning_paro.planner.workload import optimizer_states_per_param, workload_from_module

__all__ = [
    "AutoConfig",
    "CHUNK_CHOICES",
    "Candidate",
    "Cluster",
    "Compute",
    "DEFAULT_MEMORY_BUDGET",
    "GB",
    "GBIT",
    "Link",
    "MeasuredLinks",
    "Memory",
    "Plan",
    "Prediction",
    "StepTerms",
    "UNUSED_LINK",
    "Workload",
    "agreed_minimum",
    "available_host_memory",
    "describe_cluster",
    "describe_links",
    "device_memory_bytes",
    "fastest_chunk_bytes",
    "fit_link",
    "format_bytes",
    "format_plan",
    "memory_budget_bytes",
    "optimizer_states_per_param",
    "overlap_from_times",
    "plan",
    "plan_for_job",
    "predict",
    "predict_all",
    "probe_links",
    "large_gather_bytes",
    "workload_from_module",
]
