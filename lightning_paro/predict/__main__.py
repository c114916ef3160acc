"""Command line: ``python -m lightning_paro.predict status OUTPUT_DIR [--ledger URL] [--job NAME] [--json]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from lightning_paro.predict.config import LEDGER_FILE_NAME
from lightning_paro.predict.db import LedgerUnavailableError, is_postgres_url
from lightning_paro.predict.ledger import Ledger
from lightning_paro.predict.manifest import SUCCESS_NAME, read_manifest
from lightning_paro.predict.progress import read_progress


def status_report(output_dir: Path, ledger_location: Optional[str], job: Optional[str]) -> dict:
    """The job's progress, workers and completion state as a plain dict."""
    location = ledger_location or str(output_dir / LEDGER_FILE_NAME)
    if not is_postgres_url(location) and not Path(location).exists():
        raise FileNotFoundError(
            f"No prediction ledger at {location}: no job has run against {output_dir} yet, or its ledger is "
            "elsewhere (pass --ledger URL for a PostgreSQL ledger)."
        )
    ledger = Ledger(location, job or os.path.abspath(output_dir))
    try:
        if ledger.job_shape() is None:
            raise FileNotFoundError(f"The ledger at {ledger.display_location} holds no job named {ledger.job!r}.")
        progress = read_progress(ledger)
        now = ledger.now()  # the clock the workers' heartbeats are stamped with
        workers = [
            {"worker": owner, "host": host, "pid": pid, "seen_s_ago": round(now - last_seen, 1)}
            for owner, host, pid, _, last_seen in ledger.workers()
        ]
        manifest = read_manifest(output_dir)
        return {
            "job": ledger.job,
            "ledger": ledger.display_location,
            "progress": progress.as_dict(),
            "summary": progress.summary(),
            "workers": workers,
            "manifest": manifest is not None,
            "success": (output_dir / SUCCESS_NAME).exists(),
        }
    finally:
        ledger.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_paro.predict", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="show the progress of a prediction job, read from its ledger")
    status.add_argument("output_dir", type=Path)
    status.add_argument("--ledger", help="ledger location if not the default SQLite file in OUTPUT_DIR")
    status.add_argument("--job", help="job name if not the output directory's absolute path")
    status.add_argument("--json", action="store_true", help="print machine-readable JSON")
    args = parser.parse_args(argv)
    try:
        report = status_report(args.output_dir, args.ledger, args.job)
    except (FileNotFoundError, LedgerUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    state = "complete" if report["success"] else ("finished with errors" if report["manifest"] else "running")
    print(f"job {report['job']} ({state}) - ledger {report['ledger']}")
    print(report["summary"])
    for worker in report["workers"]:
        print(f"  worker {worker['worker']} on {worker['host']} pid {worker['pid']}, seen {worker['seen_s_ago']} s ago")
    return 0


if __name__ == "__main__":
    sys.exit(main())
