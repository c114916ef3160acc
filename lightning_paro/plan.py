"""``python -m lightning_paro.plan``: the candidate table and the choice of ``sharding="auto"`` for a configuration,
without training.

Example (LLaMA-7B-like, 4 nodes of 8 GPUs)::

    python -m lightning_paro.plan --params 7e9 --trainable 1.0 --nodes 4 --gpus-per-node 8 \\
        --intra-gbps 2400 --inter-gbps 200 --device-memory-gib 80 --accumulate 4 --tflops 125

The predicted tables at the PaRO paper's scale come from ``bench/auto/paper_scale.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lightning_paro.planner import (DEFAULT_MEMORY_BUDGET, Cluster, Compute, Link, Plan, Workload,
                                    fastest_chunk_bytes, format_plan, plan)
from lightning_paro.strategy.options import comm_dtype
from lightning_paro.strategy.transitions import CommDtypes

GIB = 2**30
PRECISIONS = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
"""Bytes per parameter, gradient and optimizer state per trainable parameter (Adam; bf16 adds an fp32 master)."""


# ------------------------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_paro.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=float, help="Psi: number of parameters, e.g. 7e9")
    p.add_argument("--trainable", type=float, default=1.0, help="trainable fraction Psi'/Psi (PEFT: e.g. 0.01)")
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node")
    p.add_argument("--group-size", type=int, default=None, help="m, ranks per group (default: --gpus-per-node)")
    p.add_argument("--intra-gbps", type=float, default=2400, help="intra-group bandwidth per rank, Gbit/s")
    p.add_argument("--inter-gbps", type=float, default=200, help="inter-group bandwidth per rank, Gbit/s")
    p.add_argument("--inter-per-node", action="store_true",
                   help="--inter-gbps is per node, shared by the ranks of a group")
    p.add_argument("--intra-latency-us", type=float, default=10, help="latency per ring step inside a group")
    p.add_argument("--inter-latency-us", type=float, default=20, help="latency per ring step between groups")
    p.add_argument("--intra-overlap", type=float, default=1.0,
                   help="share of an intra-group transfer hidden behind compute (1: NVLink; 0: it takes the CPU)")
    p.add_argument("--inter-overlap", type=float, default=1.0,
                   help="share of an inter-group transfer hidden behind compute (1: a NIC; 0: it takes the CPU)")
    p.add_argument("--device-memory-gib", type=float, default=80, help="memory per rank, GiB")
    p.add_argument("--memory-budget", type=float, default=DEFAULT_MEMORY_BUDGET,
                   help="fraction of memory (<= 1) or bytes (> 1) for states, in-flight buffers and activations")
    p.add_argument("--accumulate", type=int, default=1, help="A: micro-steps per optimizer step")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-step per rank")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--tflops", type=float, default=None, help="achieved TFLOP/s per rank (compute estimate)")
    p.add_argument("--micro-step-seconds", type=float, default=None, help="measured compute time of a micro-step")
    p.add_argument("--memory-bandwidth-gbs", type=float, default=2000, help="device memory GB/s (optimizer update)")
    p.add_argument("--units", type=int, default=32, help="L: repeated blocks (transformer layers)")
    p.add_argument("--root-fraction", type=float, default=0.04, help="share of parameters outside the blocks")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16",
                   help="bf16: 2/2/12 bytes (fp32 master); fp32: 4/4/8 bytes per parameter/gradient/optimizer")
    p.add_argument("--optim-bytes", type=int, default=None, help="override K, optimizer bytes per trainable param")
    p.add_argument("--param-dtype", choices=["bf16", "fp32"], default=None,
                   help="dtype parameters are gathered in (the strategy's param_dtype); default: their own")
    p.add_argument("--reduce-dtype", choices=["bf16", "fp32"], default=None,
                   help="dtype gradients are reduced in (the strategy's reduce_dtype); default: their own")
    p.add_argument("--inter-quant", choices=["int8"], default=None,
                   help="block-quantize every hop between groups (the strategy's inter_quant)")
    p.add_argument("--activation-bytes-per-token", type=float, default=0.0, help="activation memory per token")
    p.add_argument("--prefetch", type=int, default=1, help="units gathered ahead (the strategy's prefetch)")
    p.add_argument("--chunk-mib", type=float, default=None,
                   help="HO-Ring chunk in MiB (the strategy's chunk_bytes); default: the one predicted fastest")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Build the cost model's inputs from parsed arguments and plan."""
    if args.params is None:
        raise SystemExit("error: --params is required (the number of parameters, e.g. 7e9).")
    if not 0 <= args.trainable <= 1:
        raise SystemExit(f"error: --trainable is the trainable fraction, in [0, 1]; got {args.trainable}.")
    n = args.nodes * args.gpus_per_node
    m = args.group_size or args.gpus_per_node
    if n % m:
        raise SystemExit(f"error: --group-size {m} must divide the {n} ranks.")
    inter_gbps = args.inter_gbps / m if args.inter_per_node else args.inter_gbps
    pb, gb, kb = PRECISIONS[args.precision]
    tokens = args.micro_batch * args.seq_len
    try:
        workload = Workload(args.params, args.params * args.trainable, accumulation=args.accumulate,
                            num_units=args.units, root_fraction=args.root_fraction if args.units else 1.0,
                            tokens_per_micro_batch=tokens, param_bytes=pb, grad_bytes=gb,
                            optim_bytes=args.optim_bytes if args.optim_bytes is not None else kb,
                            activation_bytes_per_token=args.activation_bytes_per_token,
                            comm=CommDtypes(comm_dtype("param_dtype", args.param_dtype),
                                            comm_dtype("reduce_dtype", args.reduce_dtype), args.inter_quant))
        cluster = Cluster(n, m, Link.gbit(args.intra_gbps, args.intra_latency_us, args.intra_overlap),
                          Link.gbit(inter_gbps, args.inter_latency_us, args.inter_overlap),
                          args.device_memory_gib * GIB)
        chunk = args.chunk_mib * 2**20 if args.chunk_mib is not None else fastest_chunk_bytes(workload, cluster)
        cluster = dataclasses.replace(cluster, chunk_bytes=chunk)
        compute = Compute(micro_step_seconds=args.micro_step_seconds,
                          flops_per_second=args.tflops * 1e12 if args.tflops else None,
                          memory_bandwidth=args.memory_bandwidth_gbs * 1e9)
        return plan(workload, cluster, compute, args.memory_budget, args.prefetch)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = plan_from_args(args)
    print(format_plan(result, markdown=args.markdown))
    if args.tflops is None and args.micro_step_seconds is None:
        print("note: no --tflops or --micro-step-seconds: the ranking assumes no communication hides behind compute.")
    return 0 if result.choice else 1


if __name__ == "__main__":
    sys.exit(main())
