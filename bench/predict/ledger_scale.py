"""The shard ledger at scale: job creation, lease+commit throughput of many workers, lease latency, status time.

For each backend (SQLite file, PostgreSQL server) and each job size (default: 10 million rows in 10,000 shards and
100 million rows in 100,000 shards) it measures:

* job creation: ``Ledger.ensure_job`` inserting every shard (one transaction, bulk insert);
* lease+commit cycles per second of ``--workers`` worker processes (no model: lease a shard, write a tiny file,
  commit it) over ``--duration`` seconds, with the p50/p99 latency of a lease and of a commit;
* the lease+commit latency of a single worker with 0% and with 90% of the shards committed (it must not grow);
* the time of ``python -m lightning_paro.predict status`` (its ``status_report``) on the fresh job and at 90%.

Usage::

    python bench/predict/ledger_scale.py [--backends sqlite,postgres] [--shards 10000,100000] [--workers 32]
        [--duration 8] [--repeats 3] [--pg-url URL | --pg-start]

With ``--pg-start`` (the default when no URL is given) it starts a private PostgreSQL server of its own for the run
(``initdb`` into a temporary directory, a unix socket only) with durability as shipped: ``fsync=on``,
``synchronous_commit`` at its default, only ``max_connections`` raised for the workers; and stops it after. Otherwise
the URL comes from ``--pg-url`` or ``LIGHTNING_PARO_TEST_PG_URL`` (the test suite's server runs with ``fsync=off``:
figures against it are not durable ones). The settings that decide durability are read back from each database and
stored with the results (PostgreSQL: fsync, synchronous_commit, wal_sync_method, full_page_writes; SQLite:
synchronous, journal_mode). Results go to ``bench/results/predict/ledger_scale.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_paro.predict.__main__ import status_report  # noqa: E402
from lightning_paro.predict.db import redact_url  # noqa: E402
from lightning_paro.predict.ledger import COMMITTED, LEASED, TODO, Lease, Ledger  # noqa: E402

RESULTS = REPO / "bench" / "results" / "predict"
ROWS_PER_SHARD = 1000
LEASE_TTL_S = 120.0


PG_DURABILITY = ("fsync", "synchronous_commit", "wal_sync_method", "full_page_writes", "shared_buffers",
                 "server_version")


class PrivatePostgres:
    """A PostgreSQL server of this run's own, with its shipped durability settings (``fsync=on``)."""

    def __init__(self, max_connections: int) -> None:
        import shutil
        import subprocess

        self.subprocess = subprocess
        bindir = next((str(Path(p).parent) for p in (shutil.which("pg_ctl"),) if p), None)
        if bindir is None or not (Path(bindir) / "initdb").exists():
            candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
            if not candidates:
                raise SystemExit("PostgreSQL server binaries (pg_ctl, initdb) not found: install PostgreSQL or pass "
                                 "--pg-url")
            bindir = str(candidates[-1].parent)
        self.bin = Path(bindir)
        self.dir = Path(tempfile.mkdtemp(prefix="ledger-scale-pg-"))
        self.as_user: list = []
        user = None
        if os.getuid() == 0:  # PostgreSQL refuses to run as root
            import pwd

            try:
                pwd.getpwnam("postgres")
            except KeyError:
                subprocess.run(["useradd", "--system", "--home-dir", str(self.dir), "--shell", "/bin/false",
                                "postgres"], check=True)
            os.chown(self.dir, pwd.getpwnam("postgres").pw_uid, -1)
            self.as_user, user = ["runuser", "-u", "postgres", "--"], "postgres"
        user = user or __import__("getpass").getuser()
        data = self.dir / "data"
        subprocess.run(self.as_user + [str(self.bin / "initdb"), "-D", str(data), "-U", user, "--auth=trust",
                                       "-E", "UTF8"], check=True, capture_output=True)
        options = f"-c listen_addresses='' -c unix_socket_directories='{self.dir}' -c max_connections={max_connections}"
        subprocess.run(self.as_user + [str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.dir / "log"), "-w",
                                       "-t", "60", "-o", options, "start"], check=True, capture_output=True)
        self.data = data
        self.url = f"postgresql://{user}@/postgres?host={self.dir}"

    def stop(self) -> None:
        import shutil

        self.subprocess.run(self.as_user + [str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w",
                                            "stop"], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def durability_settings(ledger: Ledger, location: str) -> dict:
    """The settings of the ledger's database that decide what a commit survives."""
    if location.startswith("postgres"):
        return {name: str(ledger.db.query(f"SHOW {name}")[0][0]) for name in PG_DURABILITY}
    return {name: str(ledger.db.query(f"PRAGMA {name}")[0][0]) for name in ("synchronous", "journal_mode")}


def percentile(values: list, q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def write_tiny_file(directory: str, shard_id: int) -> None:
    """What a worker does between lease and commit, minus the model: publish a small file."""
    tmp = os.path.join(directory, f".s{shard_id}.tmp")
    with open(tmp, "wb") as f:
        f.write(b"shard %d\n" % shard_id)
    os.replace(tmp, os.path.join(directory, f"s{shard_id}.bin"))


def cycle(ledger: Ledger, owner: str, directory: str):
    """One lease + file + commit; returns (lease seconds, commit seconds) or None when nothing was leased."""
    t0 = time.perf_counter()
    lease = ledger.lease(owner, lease_ttl_s=LEASE_TTL_S)
    t1 = time.perf_counter()
    if not isinstance(lease, Lease):
        return None
    write_tiny_file(directory, lease.shard_id)
    t2 = time.perf_counter()
    ledger.commit(lease.shard_id, owner, lease.end_row - lease.start_row, 0, f"s{lease.shard_id}.bin")
    return t1 - t0, time.perf_counter() - t2


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process of this machine has used so far, from /proc (0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def worker(location: str, job: str, directory: str, index: int, ready, start, deadline_box, results) -> None:
    owner = f"bench-{index}"
    leases, commits, ends = [], [], []
    cpu = [0.0, 0.0]  # this worker's CPU seconds, its PostgreSQL backend's
    try:
        ledger = Ledger(location, job)
        backend_pid = int(ledger.db.query("SELECT pg_backend_pid()")[0][0]) if location.startswith("postgres") else 0
        ready.wait()
        start.wait()
        deadline = deadline_box.value
        cpu0, server0 = time.process_time(), process_cpu_s(backend_pid) if backend_pid else 0.0
        while time.time() < deadline:
            timing = cycle(ledger, owner, directory)
            if timing is None:
                break
            leases.append(timing[0])
            commits.append(timing[1])
            ends.append(time.time())
        cpu = [time.process_time() - cpu0, (process_cpu_s(backend_pid) - server0) if backend_pid else 0.0]
        ledger.close()
        results.put((index, leases, commits, ends[-1] if ends else None, None, cpu))
    except BaseException as exc:  # report, never hang the parent
        results.put((index, leases, commits, None, redact_url(f"{type(exc).__name__}: {exc}"), cpu))


def throughput(location: str, job: str, workers: int, duration_s: float, directory: str) -> dict:
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Barrier(workers + 1)
    start = ctx.Barrier(workers + 1)
    deadline_box = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(location, job, directory, i, ready, start, deadline_box, results))
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    ready.wait(timeout=300)  # every worker has its connection open
    begin = time.time()
    deadline_box.value = begin + duration_s
    start.wait(timeout=60)
    collected = [results.get(timeout=duration_s + 600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [c[4] for c in collected if c[4]]
    if errors:
        raise RuntimeError(f"{len(errors)} workers failed, first: {errors[0]}")
    leases = [x for c in collected for x in c[1]]
    commits = [x for c in collected for x in c[2]]
    end = max((c[3] for c in collected if c[3] is not None), default=begin)
    elapsed = max(end - begin, 1e-9)
    client_cpu = sum(c[5][0] for c in collected)
    server_cpu = sum(c[5][1] for c in collected)
    per_cycle_ms = 1e3 * (client_cpu + server_cpu) / max(len(leases), 1)
    return {
        "workers": workers,
        "cycles": len(leases),
        "seconds": round(elapsed, 3),
        "cycles_per_s": round(len(leases) / elapsed, 1),
        "lease_p50_ms": round(1e3 * percentile(leases, 0.50), 3),
        "lease_p99_ms": round(1e3 * percentile(leases, 0.99), 3),
        "commit_p50_ms": round(1e3 * percentile(commits, 0.50), 3),
        "commit_p99_ms": round(1e3 * percentile(commits, 0.99), 3),
        # CPU spent per cycle by the workers and (PostgreSQL) their server backends: with C cores the cycles per
        # second cannot exceed C * 1000 / cpu_ms_per_cycle, whatever the number of workers
        "worker_cpu_ms_per_cycle": round(1e3 * client_cpu / max(len(leases), 1), 3),
        "server_cpu_ms_per_cycle": round(1e3 * server_cpu / max(len(leases), 1), 3),
        "cpu_bound_cycles_per_s": round((os.cpu_count() or 1) * 1e3 / per_cycle_ms, 1) if per_cycle_ms else None,
    }


def single_worker_cycles(ledger: Ledger, directory: str, count: int) -> dict:
    timings = [t for t in (cycle(ledger, "bench-single", directory) for _ in range(count)) if t is not None]
    return {
        "lease_p50_ms": round(1e3 * percentile([t[0] for t in timings], 0.5), 3),
        "commit_p50_ms": round(1e3 * percentile([t[1] for t in timings], 0.5), 3),
        "cycle_p50_ms": round(1e3 * percentile([t[0] + t[1] for t in timings], 0.5), 3),
    }


def status_seconds(output_dir: Path, location: str, job: str, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        status_report(output_dir, location, job)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 3)


def commit_fraction(ledger: Ledger, shards: int, fraction: float) -> None:
    """Leaves exactly the first ``fraction`` of the shards committed (as if workers had done them) and the rest
    todo (the many-worker phase may have committed any number of them), in one transaction."""
    cut = int(shards * fraction)
    with ledger.db.transaction(ledger.job) as tx:
        tx.execute(
            "UPDATE paro_predict_shards SET state = $1, rows_written = end_row - start_row, rows_failed = 0, "
            "file = 'f', committed_at = $2, committed_by = 'bench', owner = 'bench' "
            "WHERE job = $3 AND shard_id < $4 AND state IN ($5, $6)",
            (COMMITTED, time.time(), ledger.job, cut, TODO, LEASED),
        )
        tx.execute(
            "UPDATE paro_predict_shards SET state = $1, owner = NULL, lease_expires = NULL, leased_at = NULL, "
            "rows_written = NULL, rows_failed = NULL, file = NULL, committed_at = NULL, committed_by = NULL "
            "WHERE job = $2 AND shard_id >= $3 AND state <> $4",
            (TODO, ledger.job, cut, TODO),
        )


def vacuum(ledger: Ledger) -> None:
    """``VACUUM paro_predict_shards`` (PostgreSQL; it cannot run inside a transaction)."""
    conn = ledger.db._conn
    conn.commit()
    conn.autocommit = True
    try:
        conn.execute("VACUUM paro_predict_shards")
    finally:
        conn.autocommit = False


def run_one(backend: str, location: str, shards: int, args, scratch: Path) -> dict:
    job = f"bench-ledger-scale-{uuid.uuid4().hex[:8]}"
    out = scratch / job
    out.mkdir(parents=True)
    rows = shards * ROWS_PER_SHARD
    record = {"backend": backend, "shards": shards, "rows": rows, "load_average_1m": round(os.getloadavg()[0], 1)}
    ledger = Ledger(location, job)
    try:
        record["durability"] = durability_settings(ledger, location)
        t0 = time.perf_counter()
        ledger.ensure_job(rows, ROWS_PER_SHARD)
        record["create_s"] = round(time.perf_counter() - t0, 3)
        record["status_fresh_s"] = status_seconds(out, location, job)
        record["single_at_0pct"] = single_worker_cycles(ledger, str(out), args.single_cycles)
        print(f"  {backend} {shards:,} shards: created in {record['create_s']} s; {args.workers} workers for "
              f"{args.duration} s ...", flush=True)
        ledger.close()
        record["throughput"] = throughput(location, job, args.workers, args.duration, str(out))
        ledger = Ledger(location, job)
        commit_fraction(ledger, shards, 0.9)
        record["single_at_90pct"] = single_worker_cycles(ledger, str(out), args.single_cycles)
        record["status_90pct_s"] = status_seconds(out, location, job)
        at0 = record["single_at_0pct"]["cycle_p50_ms"]
        record["cycle_90_over_0"] = round(record["single_at_90pct"]["cycle_p50_ms"] / at0, 2) if at0 else None
        if backend == "postgres":
            # the 90% were marked in one statement: their old index entries stay until (auto)vacuum removes them
            vacuum(ledger)
            record["single_at_90pct_vacuumed"] = single_worker_cycles(ledger, str(out), args.single_cycles)
    finally:
        try:
            with ledger.db.transaction(job) as tx:  # keep a shared PostgreSQL database small between runs
                for table in ("paro_predict_shards", "paro_predict_workers", "paro_predict_jobs"):
                    tx.execute(f"DELETE FROM {table} WHERE job = $1", (job,))
        finally:
            ledger.close()
    print("  " + json.dumps(record), flush=True)
    return record


def table(records: list, meta: dict) -> str:
    lines = [
        "| backend | shards (rows) | create s | cycles/s, "
        f"{meta['workers']} workers (median; each run) | CPU ms per cycle (workers + server) | lease p50 / p99 ms | commit p50 / p99 ms | 1 worker cycle ms at 0% / 90% "
        "committed | status s fresh / 90% | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        t = r["throughput"]
        after = r.get("single_at_90pct_vacuumed")
        vacuumed = f"; {after['cycle_p50_ms']:.2f} after VACUUM" if after else ""
        lines.append(
            f"| {r['backend']} | {r['shards']:,} ({r['rows'] / 1e6:g} M) | {r['create_s']:.2f} | {t['cycles_per_s']:,.0f} "
            f"({', '.join(f'{c:,.0f}' for c in r.get('cycles_per_s_runs', [t['cycles_per_s']]))}) "
            f"| {t['worker_cpu_ms_per_cycle']:.2f} + {t['server_cpu_ms_per_cycle']:.2f} "
            f"| {t['lease_p50_ms']:.1f} / {t['lease_p99_ms']:.1f} | {t['commit_p50_ms']:.1f} / {t['commit_p99_ms']:.1f} "
            f"| {r['single_at_0pct']['cycle_p50_ms']:.2f} / {r['single_at_90pct']['cycle_p50_ms']:.2f} "
            f"({r['cycle_90_over_0']}x{vacuumed}) | {r['status_fresh_s']:.2f} / {r['status_90pct_s']:.2f} "
            f"| {r['load_average_1m']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--shards", default="10000,100000")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of the many-worker phase")
    parser.add_argument("--single-cycles", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each backend and size (a fresh job each); the run of median cycles/s is shown")
    parser.add_argument("--pg-url", default=None, help="an existing server's URL (default: --pg-start)")
    parser.add_argument("--pg-start", action="store_true",
                        help="start a private server with fsync=on for the run (the default without --pg-url)")
    parser.add_argument("--scratch", default=None, help="directory for the SQLite ledgers and tiny files")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()

    meta = {
        "repeats": args.repeats,
        "workers": args.workers,
        "duration_s": args.duration,
        "rows_per_shard": ROWS_PER_SHARD,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "finished": None,
    }
    records = []
    server = None
    if "postgres" in args.backends.split(",") and (args.pg_start or not args.pg_url):
        server = PrivatePostgres(max_connections=args.workers + 20)
        args.pg_url = server.url
        meta["postgres_server"] = "started by this run: initdb defaults (fsync=on, synchronous_commit as shipped)"
    try:
        run_all(args, records)
    finally:
        if server is not None:
            server.stop()
    meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=REPO).stdout.strip()
    meta["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    meta["platform"] = platform.platform()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    text = table(records, meta)
    print(text)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        sys.path.insert(0, str(REPO / "bench"))
        import provenance

        stored = {"meta": meta, "records": records, "provenance": provenance.stamp()}
        (RESULTS / "ledger_scale.json").write_text(json.dumps(stored, indent=2) + "\n")
        durability = "; ".join(
            f"{r['backend']}: " + ", ".join(f"{k}={v}" for k, v in r["durability"].items())
            for r in {r["backend"]: r for r in records}.values()
        )
        settings = (
            f"{args.workers} worker processes, {args.duration:g} s each run, {args.repeats} runs of each backend and "
            f"size (a fresh job each; the row is the run of median cycles/s), {ROWS_PER_SHARD} rows per shard, "
            f"{meta['cpus']} CPUs ({meta['platform']}), commit {meta['commit']}; durability as read back from the "
            f"databases: {durability}; load avg: the machine's 1-minute load average when each row started (other "
            f"jobs included); finished {meta['finished']}."
        )
        (RESULTS / "ledger_scale.md").write_text(f"# Ledger at scale\n\n{settings}\n\n{text}\n")


def run_all(args, records: list) -> None:
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="ledger-scale-") as scratch_dir:
        scratch = Path(scratch_dir)
        for backend in args.backends.split(","):
            if backend == "postgres" and not args.pg_url:
                print("no PostgreSQL URL: skipping postgres", flush=True)
                continue
            for shards in (int(s) for s in args.shards.split(",")):
                runs = []
                for repeat in range(args.repeats):
                    location = (args.pg_url if backend == "postgres"
                                else str(scratch / f"ledger-{shards}-{repeat}.sqlite"))
                    runs.append(run_one(backend, location, shards, args, scratch))
                # the run of median throughput stands for the setting; every run's rate is kept beside it
                runs.sort(key=lambda r: r["throughput"]["cycles_per_s"])
                record = dict(runs[len(runs) // 2])
                record["cycles_per_s_runs"] = [r["throughput"]["cycles_per_s"] for r in runs]
                record["runs"] = runs
                records.append(record)


if __name__ == "__main__":
    main()
