"""A compute-bound workload whose read path costs real CPU: compressed documents from a local object store, decoded
and tokenized in the DataLoader workers, a 3-layer transformer encoder on the same two cores.

Written as a user would write it for plain ``Trainer.predict``: a map-style dataset that fetches one object per row
over HTTP (no keep-alive, as ``urllib`` does), decompresses it, parses the JSON, normalises and splits the text with a
regular expression, maps each word to an id by hashing, adds hashed word bigrams, and pads to ``SEQ_LEN``. Nothing in it
knows about ElasticPredict.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
import urllib.request
import zlib

import numpy as np
import torch
from torch.utils.data import Dataset

from workload import TinyEncoder

SEQ_LEN = 128
VOCAB = 4096
ENCODER = dict(width=256, layers=3, heads=4)
_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def _hash_id(token: str) -> int:
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=4).digest(), "little") % (VOCAB - 2) + 2


def tokenize(text: str) -> np.ndarray:
    """Word and bigram ids of ``text``: NFKC-normalised, lower-cased, split into words and punctuation."""
    words = _WORD.findall(unicodedata.normalize("NFKC", text).lower())
    ids = [_hash_id(w) for w in words]
    bigrams = [_hash_id(a + " " + b) for a, b in zip(words, words[1:])]
    merged = [1] + [x for pair in zip(ids, bigrams) for x in pair]  # 1: the start token
    arr = np.zeros(SEQ_LEN, dtype=np.int64)
    arr[: min(SEQ_LEN, len(merged))] = merged[:SEQ_LEN]
    return arr


class StoredDocuments(Dataset):
    """Row ``i`` is the compressed document ``{url}/doc/{i}``, decoded and tokenized."""

    def __init__(self, url: str, rows: int) -> None:
        self.url = url
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict:
        with urllib.request.urlopen(f"{self.url}/doc/{index}", timeout=30) as resp:
            doc = json.loads(zlib.decompress(resp.read()))
        return {"tokens": torch.from_numpy(tokenize(doc["title"] + " " + doc["body"])), "id": doc["id"]}


def build_encoder() -> torch.nn.Module:
    return TinyEncoder(**ENCODER).eval()
