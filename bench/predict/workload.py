"""The benchmark workload: records fetched over HTTP, CPU preprocessing, small transformers."""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.request
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

SEQ_LEN = 64
VOCAB = 4096


def preprocess(text: str) -> torch.Tensor:
    """Tokenise by hashing words, then a little numeric work: the CPU part of the read path."""
    ids = [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % VOCAB for w in text.split()]
    ids = (ids + [0] * SEQ_LEN)[:SEQ_LEN]
    arr = np.asarray(ids, dtype=np.int64)
    return torch.from_numpy(arr)


class HttpRecords(Dataset):
    """Row ``i`` is fetched from ``{url}/obj/{i}`` (one request per row, as from an object store)."""

    def __init__(self, url: Optional[str], rows: int) -> None:
        self.url = url
        self.rows = rows
        self._local = threading.local()

    def __getstate__(self):
        return {"url": self.url, "rows": self.rows}

    def __setstate__(self, state):
        self.__init__(state["url"], state["rows"])

    def __len__(self) -> int:
        return self.rows

    def _fetch(self, index: int) -> dict:
        if self.url is None:  # compute-bound variant: the same record, generated locally
            from object_store import record

            return json.loads(record(index))
        with urllib.request.urlopen(f"{self.url}/obj/{index}", timeout=30) as resp:
            return json.loads(resp.read())

    def __getitem__(self, index: int) -> dict:
        rec = self._fetch(index)
        return {"tokens": preprocess(rec["text"]), "id": rec["id"]}


class ThreadedHttpRecords(HttpRecords):
    """``HttpRecords`` whose batches are fetched by a thread pool of ``threads`` in each DataLoader worker: the I/O
    concurrency a user gives plain ``Trainer.predict`` through ``__getitems__``, which the DataLoader calls with a
    batch's indices."""

    def __init__(self, url: Optional[str], rows: int, threads: int = 16) -> None:
        super().__init__(url, rows)
        self.threads = threads
        self._pool = None

    def __getstate__(self):
        return {"url": self.url, "rows": self.rows, "threads": self.threads}

    def __setstate__(self, state):
        self.__init__(state["url"], state["rows"], state["threads"])

    def __getitems__(self, indices: list) -> list:
        if self._pool is None:  # made in the DataLoader worker that uses it
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads)
        return list(self._pool.map(self.__getitem__, indices))


class TinyEncoder(torch.nn.Module):
    """A small transformer encoder producing a pooled embedding per row."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(tokens)).mean(dim=1)


class Scorer(torch.nn.Module):
    """Second model of the multi-model pipeline: a heavier encoder over the first model's embedding sequence."""

    def __init__(self, width: int = 128, layers: int = 4, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.expand = torch.nn.Linear(width, width * 16)
        layer = torch.nn.TransformerEncoderLayer(width, 4, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, 4)
        self.width = width

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        seq = self.expand(embedding).view(embedding.shape[0], 16, self.width)
        return torch.softmax(self.head(self.encoder(seq).mean(dim=1)), dim=-1)
