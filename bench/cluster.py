"""An emulated multi-node cluster on one Linux machine: network namespaces as nodes, shaped veth links as NICs.

Each node is a network namespace. Ranks of one node talk over its loopback (fast, like NVLink); nodes reach each other
through veth pairs into one bridge, which lives in a namespace of its own so the host's network is never touched. Each
veth is shaped with a ``tc`` token bucket in both directions, so it behaves like a full-duplex NIC of the given rate.

Two NIC models:

* ``node``: one NIC per node, shared by all its ranks.
* ``rank``: one NIC per rank ("rail-optimized"): a node has one interface per local index j, each rank binds its own
  (``GLOO_SOCKET_IFNAME``), and NIC j of every node is in the subnet of rail j. Traffic is routed by destination: a
  message to a rank on rail j leaves the node by NIC j, as on a rail-optimized fabric where cross-rail traffic is
  first moved inside the node to the destination's rail (NCCL's PXN does this). Routing by source address
  (``ip rule from ADDR``) does not work here: gloo binds the listening socket to the interface but not the sockets it
  connects from, so half of a rank's connections would carry a source address the rule never sees.

Usage as a script (root, iproute2)::

    python bench/cluster.py --nodes 2 --ranks-per-node 2 --rate-mbit 1000 --nic node -- worker.py ARGS...

runs ``worker.py`` as every rank, with the torch.distributed environment set, and removes every namespace afterwards,
also on errors, Ctrl-C and SIGTERM. As a library: ``with Cluster(ClusterConfig(...)) as c: c.run([...])``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal, Sequence

NicModel = Literal["node", "rank"]
Placement = Literal["contiguous", "round-robin"]


@dataclass(frozen=True)
class ClusterConfig:
    """Shape of the emulated cluster."""

    nodes: int = 2
    """Number of nodes (network namespaces)."""
    ranks_per_node: int = 2
    """Processes per node."""
    rate_mbit: int = 1000
    """Rate of every NIC, each direction, in Mbit/s (keep 100-1000 so the network, not the CPU, is the bottleneck)."""
    nic: NicModel = "node"
    """``node``: one NIC per node; ``rank``: one NIC per rank, with source routing."""
    placement: Placement = "contiguous"
    """How global ranks map to nodes: ``contiguous`` (rank = node * m + local) or ``round-robin`` (node = rank % g)."""
    prefix: str = "hor"
    """Namespace name prefix; namespaces with this prefix are removed before and after a run."""
    subnet: str = "10.213"
    """First two octets of the private addresses (``.<nic+1>.<node+1>``; they exist only inside the namespaces)."""
    burst_bytes: int = 256 * 1024
    """Token-bucket burst; at least 64 KiB or the shaped rate falls well below the set rate."""
    queue_ms: float = 10.0
    """Longest a packet may wait in a NIC's queue. Shallow, like a switch port: deep queues delay the ACKs of one
    direction behind the data of the other, and TCP then stalls on its window when both directions are busy."""
    mtu: int = 1500
    """MTU of the emulated NICs."""
    master_port: int = 29531
    """TCP port of the torch.distributed rendezvous on rank 0's address."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError("nodes and ranks_per_node must be >= 1.")
        if self.nodes > 250 or self.ranks_per_node > 250:
            raise ValueError("at most 250 nodes and 250 ranks per node fit the address plan.")
        if self.burst_bytes < 64 * 1024:
            raise ValueError(f"burst_bytes={self.burst_bytes} is below 64 KiB: tbf would not reach its rate.")
        if self.nic not in ("node", "rank") or self.placement not in ("contiguous", "round-robin"):
            raise ValueError(f"nic must be 'node' or 'rank' and placement 'contiguous' or 'round-robin', got "
                             f"{self.nic!r}, {self.placement!r}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def nics_per_node(self) -> int:
        return self.ranks_per_node if self.nic == "rank" else 1

    def node_of(self, rank: int) -> tuple[int, int]:
        """(node, local rank) of a global rank under the configured placement."""
        if self.placement == "contiguous":
            return divmod(rank, self.ranks_per_node)
        return rank % self.nodes, rank // self.nodes

    def node_ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def nic_name(self, local: int) -> str:
        """Interface a rank with this local index binds (its node's only NIC in the ``node`` model)."""
        return f"eth{local if self.nic == 'rank' else 0}"

    def address(self, node: int, nic: int) -> str:
        return f"{self.subnet}.{nic + 1}.{node + 1}"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def require_root_and_iproute2() -> None:
    """Refuse clearly without root; install iproute2 with apt-get when it is missing and that is possible."""
    if os.geteuid() != 0:
        raise SystemExit("The emulated cluster needs root (it creates network namespaces and shapes links with tc): "
                         "run it with sudo, or as root in a container with CAP_NET_ADMIN.")
    if shutil.which("ip") and shutil.which("tc"):
        return
    if shutil.which("apt-get"):
        print("iproute2 is missing: installing it with apt-get", file=sys.stderr)
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "iproute2"], check=False)
    if not (shutil.which("ip") and shutil.which("tc")):
        raise SystemExit("iproute2 ('ip' and 'tc') is required and could not be installed: install the iproute2 "
                         "package with your distribution's package manager.")


def existing_namespaces(prefix: str) -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n == f"{prefix}-sw" or n.startswith(f"{prefix}-n")]


class Cluster:
    """Creates the namespaces, links and shaping on enter, and removes all of it on exit (also after errors)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict = {}
        self._lock = None

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> Cluster:
        require_root_and_iproute2()
        # A signal becomes an exception, so the teardown in __exit__ runs however the run ends.
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._hold_prefix()
            self.teardown()  # leftovers of a run that was killed with SIGKILL
            self._create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.kill_all()
            if self._lock is not None:  # only the holder of the prefix may remove its namespaces
                self.teardown()
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()

    def _hold_prefix(self) -> None:
        """Wait until no other cluster of this prefix runs, and hold the prefix for this one's life. Namespaces are
        named by the prefix, so a second cluster's set-up would delete the first one's and cut its ranks off."""
        import fcntl

        self._lock = open(f"/tmp/{self.config.prefix}-cluster.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for the other emulated cluster of prefix {self.config.prefix!r} to finish", file=sys.stderr,
                  flush=True)
            fcntl.flock(self._lock, fcntl.LOCK_EX)

    @staticmethod
    def _on_signal(signum, _frame) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def teardown(self) -> None:
        """Delete every namespace of this cluster's prefix (their interfaces and qdiscs go with them)."""
        for ns in existing_namespaces(self.config.prefix):
            _run("ip", "netns", "del", ns, check=False)
        left = existing_namespaces(self.config.prefix)
        if left:
            raise RuntimeError(f"could not delete network namespaces {left}: stop the processes still inside them "
                               f"(ip netns pids NAME) and run 'ip netns del NAME'.")

    def _create(self) -> None:
        c = self.config
        sw = c.switch_ns
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for node in range(c.nodes):
            ns = c.node_ns(node)
            _run("ip", "netns", "add", ns)
            # Without lo up, connecting to the node's own address (same-node ranks) hangs silently.
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if c.nic == "rank":
                # Several interfaces on one bridge: answer ARP only on the interface that owns the address, and
                # accept packets whichever interface they arrive on.
                for key, value in (("arp_ignore", "1"), ("arp_announce", "2"), ("rp_filter", "0")):
                    for scope in ("all", "default"):
                        _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.{scope}.{key}={value}")
            for nic in range(c.nics_per_node):
                outer, inner, addr = f"n{node}e{nic}", f"eth{nic}", c.address(node, nic)
                _run("ip", "-n", sw, "link", "add", outer, "mtu", str(c.mtu), "type", "veth", "peer", "name", inner,
                     "mtu", str(c.mtu), "netns", ns)
                _run("ip", "-n", sw, "link", "set", outer, "master", "br0", "up")
                # One /24 per rail (NIC index): the destination's rail picks the interface a message leaves by.
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
                _run("ip", "-n", ns, "link", "set", inner, "up")
                # Shape both directions: node -> switch on the inner end, switch -> node on the outer end.
                self._shape(ns, inner)
                self._shape(sw, outer)

    def _shape(self, ns: str, dev: str) -> None:
        c = self.config
        # The bucket must hold at least one timer tick of traffic at the rate, else tbf cannot reach the rate.
        burst = max(c.burst_bytes, c.rate_mbit * 1_000_000 // 8 // 250)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{c.rate_mbit}mbit",
             "burst", str(burst), "latency", f"{c.queue_ms}ms")

    # ---------------------------------------------------------------- ranks
    def rank_env(self, rank: int) -> dict[str, str]:
        """torch.distributed environment of one rank (as torchrun would set it), plus the interface gloo must use."""
        c = self.config
        node, local = c.node_of(rank)
        master_node, master_local = c.node_of(0)
        master_nic = master_local if c.nic == "rank" else 0
        return {
            "MASTER_ADDR": c.address(master_node, master_nic), "MASTER_PORT": str(c.master_port),
            "WORLD_SIZE": str(c.world_size), "RANK": str(rank), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(c.ranks_per_node), "NODE_RANK": str(node), "GROUP_RANK": str(node),
            # Without it gloo advertises 127.0.0.1 and peers on other nodes cannot connect.
            "GLOO_SOCKET_IFNAME": c.nic_name(local),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "CLUSTER_NIC_MODEL": c.nic, "CLUSTER_PLACEMENT": c.placement, "CLUSTER_RATE_MBIT": str(c.rate_mbit),
            "CLUSTER_NODES": str(c.nodes),
        }

    def run(self, argv: Sequence[str], timeout: float = 600, extra_env: dict[str, str] | None = None) -> list[str]:
        """Run ``python argv...`` as every rank, each in its node's namespace; return the outputs by rank.

        Raises with the failing rank's output if any rank fails or the timeout passes; all ranks are killed then.
        """
        self._procs = []
        for rank in range(self.config.world_size):
            env = dict(os.environ)
            env.update(self.rank_env(rank))
            env.update(extra_env or {})
            ns = self.config.node_ns(self.config.node_of(rank)[0])
            self._procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *argv], env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                start_new_session=True))
        deadline = time.monotonic() + timeout
        outputs = []
        try:
            for rank, p in enumerate(self._procs):
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                outputs.append(out)
                if p.returncode != 0:
                    raise RuntimeError(f"rank {rank} exited with {p.returncode}:\n{out[-6000:]}")
        finally:
            self.kill_all()
        return outputs

    def kill_all(self) -> None:
        """Kill every rank this cluster started (each leads its own process group) and reap it."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.communicate(timeout=10)
            except Exception:
                pass
        self._procs = []

    # ---------------------------------------------------------------- measurements
    def nic_tx_bytes(self) -> dict[str, int]:
        """Bytes sent so far by every emulated NIC, keyed ``node<i>/eth<k>`` (read from the namespaces)."""
        out = {}
        for node in range(self.config.nodes):
            stats = json.loads(_run("ip", "-j", "-s", "-n", self.config.node_ns(node), "link", "show").stdout)
            for link in stats:
                if link["ifname"].startswith("eth"):
                    out[f"node{node}/{link['ifname']}"] = link["stats64"]["tx"]["bytes"]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rate-mbit", type=int, default=1000)
    ap.add_argument("--nic", choices=["node", "rank"], default="node")
    ap.add_argument("--placement", choices=["contiguous", "round-robin"], default="contiguous")
    ap.add_argument("--queue-ms", type=float, default=ClusterConfig.queue_ms)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- script.py args...: what every rank runs")
    args = ap.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        ap.error("give the script every rank runs after --")
    cfg = ClusterConfig(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate_mbit=args.rate_mbit, nic=args.nic,
                        placement=args.placement, queue_ms=args.queue_ms)
    with Cluster(cfg) as cluster:
        before = cluster.nic_tx_bytes()
        outputs = cluster.run(argv, timeout=args.timeout)
        after = cluster.nic_tx_bytes()
    for rank, out in enumerate(outputs):
        for line in out.splitlines():
            print(f"[rank {rank}] {line}")
    for nic, b in after.items():
        print(f"{nic}: sent {(b - before[nic]) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
