"""Time passing for a ledger in tests: the database's clock cannot be set, so a job's stored times are moved back."""

from __future__ import annotations

from lightning_paro.predict.ledger import Ledger

_TIMES = {
    "paro_predict_shards": ("lease_expires", "leased_at", "spec_expires", "committed_at"),
    "paro_predict_workers": ("started_at", "last_seen"),
    "paro_predict_jobs": ("created_at",),
}


def pass_time(ledger: Ledger, seconds: float) -> None:
    """As if ``seconds`` passed on the database's clock for ``ledger``'s job: every time it stores moves back."""
    with ledger.db.transaction(ledger.job) as tx:
        for table, columns in _TIMES.items():
            moved = ", ".join(f"{c} = {c} - $2" for c in columns)
            tx.execute(f"UPDATE {table} SET {moved} WHERE job = $1", (ledger.job, seconds))
