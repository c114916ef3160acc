"""The predict progress bar knows how many batches the job has and ends at the batches this worker ran."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader

from lightning_paro.predict import ElasticPredict
from predict_app import Affine, JobSpec, RowsDataset


@pytest.mark.timeout(120)
def test_the_bar_has_a_total_and_ends_at_the_batches_run(tmp_path):
    spec = JobSpec(output_dir=str(tmp_path / "out"), rows=95, batch_size=10, shard_size=30)
    bar = TQDMProgressBar()
    elastic = ElasticPredict(str(tmp_path / "out"), shard_size=spec.shard_size)
    totals = []

    class Watch(L.Callback):
        def on_predict_batch_end(self, trainer, *args):
            totals.append(bar.predict_progress_bar.total)

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False,
                        callbacks=[elastic, Watch(), bar])
    trainer.predict(Affine(spec), DataLoader(RowsDataset(spec), batch_size=spec.batch_size))
    # shards of 30, 30, 30 and 5 rows in batches of 10: 3 + 3 + 3 + 1
    assert elastic.batches_run == 10
    # the total is the job's from the first batch on; empty waits for the last commits may push it up, never down
    assert totals[0] == 10 and totals == sorted(totals)
    final = bar._predict_progress_bar
    assert final.n == final.total == 10
