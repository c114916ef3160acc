"""CPU cost of passing one batch between the stage processes of ``run_pipeline``, per row.

    OMP_NUM_THREADS=1 python bench/predict/stage_transport.py [--batches 2000] [--repeats 5]

Builds the three messages of the benchmark's two-model pipeline (``configs.pipeline``: batches of 32 rows of 64
int64 tokens, an encoder of width 256, a scorer with 4 outputs), each as the pipeline builds it:

* ``driver -> encode``: the DataLoader's batch (``{"tokens": int64[32, 64], "id": int64[32]}``) in its
  ``ElasticBatch``;
* ``encode -> score``: the rows that passed, with the encoder's output (``{"embedding": float32[32, 256]}``);
* ``score -> driver``: the ``("done", seq, StepOutcome)`` result with the scorer's output (the embedding and
  ``float32[32, 4]`` scores).

For each, a forked receiver takes ``--batches`` messages from a bounded ``multiprocessing`` queue (as
``StageGraph``'s, 4 deep) and unpacks them, while this process packs and puts them. The CPU time of both processes
(the sender's queue feeder thread included) over the messages, per row, is the transport's cost; a model stage pays
the receiving side of its input and the sending side of its output. Measured for ``pack`` (``stages.pack``, what
the pipeline uses: plain pickling, tensors serialised by torch's own reducer) and, for reference, ``arrays`` (CPU
tensors pickled as NumPy arrays, protocol 5; not used by the pipeline), with the median of ``--repeats`` runs;
``pickling`` is the same message's ``dumps`` plus ``loads`` in one process, without the queue. Prints a table and
each model stage's share against :data:`MODEL_STAGE_CPU_MS`; writes nothing.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_paro.predict.batch import BatchTicket, ElasticBatch, StepOutcome  # noqa: E402
from lightning_paro.predict.stages import pack, unpack  # noqa: E402
from workload import SEQ_LEN, VOCAB  # noqa: E402

ROWS = 32
"""Rows per batch (``configs.BATCH``)."""
WIDTH = 256
"""The encoder's output width (``configs.ENCODER``)."""
SCORES = 4
"""The scorer's outputs per row."""


def messages() -> dict[str, Any]:
    """The three messages of one batch's trip through the two-stage pipeline."""
    ticket = BatchTicket(3, 768, 1024, range(800, 800 + ROWS), False, 1)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ_LEN), dtype=torch.int64)
    ids = torch.arange(800, 800 + ROWS, dtype=torch.int64)
    loaded = ElasticBatch(data={"tokens": tokens, "id": ids}, ticket=ticket, indices=ticket.indices, fetch_threads=8)
    with torch.inference_mode():
        embedding = torch.randn(ROWS, WIDTH)
        scores = torch.softmax(torch.randn(ROWS, SCORES), dim=-1)
    encoded = ElasticBatch(data={"embedding": embedding}, ticket=ticket, indices=ticket.indices)
    outcome = StepOutcome(ticket=ticket, chunks=[(range(ROWS), {"embedding": embedding, "scores": scores})],
                          indices=ticket.indices)
    return {
        "driver -> encode": (17, loaded),
        "encode -> score": (17, encoded),
        "score -> driver": ("done", 17, outcome),
    }


MODEL_STAGE_CPU_MS = 1.7
"""CPU milliseconds per row of each model stage of the benchmark (1.66 and 1.69 measured, docs/predict.md)."""


class _ArraysPickler(pickle.Pickler):
    """Pickles CPU tensors as NumPy arrays (their bytes, copied once) instead of through torch's reducer."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad:
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


def arrays_dumps(item: Any) -> bytes:
    buffer = io.BytesIO()
    _ArraysPickler(buffer, protocol=5).dump(item)
    return buffer.getvalue()


PACKINGS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], Any]]] = {
    "pack": (pack, unpack),
    "arrays": (arrays_dumps, pickle.loads),
}


def pickling_cpu_s(item: Any, packing: str, count: int) -> float:
    """CPU seconds of packing and unpacking ``item`` ``count`` times in this process."""
    dumps, loads = PACKINGS[packing]
    start = time.process_time()
    for _ in range(count):
        loads(dumps(item))
    return time.process_time() - start


def _receive(inbox, report, count: int, packing: str) -> None:
    """The receiving stage: takes and unpacks ``count`` messages, then reports its CPU seconds."""
    loads = PACKINGS[packing][1]
    loads(inbox.get())  # the first message starts the sender's feeder thread: not part of the timing
    start = time.process_time()
    for _ in range(count):
        loads(inbox.get())
    report.put(time.process_time() - start)


def transport_cpu_s(item: Any, packing: str, count: int) -> tuple[float, float, float]:
    """(sender CPU s, receiver CPU s, wall s) to pass ``item`` ``count`` times between two processes."""
    ctx = multiprocessing.get_context("fork")
    inbox, report = ctx.Queue(maxsize=4), ctx.Queue()
    receiver = ctx.Process(target=_receive, args=(inbox, report, count, packing), daemon=True)
    receiver.start()
    dumps = PACKINGS[packing][0]
    inbox.put(dumps(item))  # the queue's feeder thread starts on the first put: not part of the timing
    time.sleep(0.2)
    wall = time.perf_counter()
    sender = time.process_time()
    for _ in range(count):
        inbox.put(dumps(item))
    receiver_s = report.get()
    sender_s = time.process_time() - sender
    wall = time.perf_counter() - wall
    receiver.join()
    return sender_s, receiver_s, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000, help="messages per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per message and packing (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"batches of {ROWS} rows, {args.batches} messages per measurement, median of {args.repeats}; "
          f"CPU µs per row; load average {os.getloadavg()[0]:.1f}")
    print("| message | packing | bytes | pickling | sender | receiver | both | wall µs per row |")
    print("|---|---|---|---|---|---|---|---|")
    per_row = 1e6 / (args.batches * ROWS)
    sides: dict[tuple[str, str], tuple[float, float]] = {}  # (message, packing) -> (sender, receiver) µs per row
    for name, item in messages().items():
        for packing, (dumps, loads) in PACKINGS.items():
            assert _same(loads(dumps(item)), item), f"{packing} changed the {name} message"
            pickling = statistics.median(pickling_cpu_s(item, packing, args.batches) for _ in range(args.repeats))
            runs = [transport_cpu_s(item, packing, args.batches) for _ in range(args.repeats)]
            sender = statistics.median(r[0] for r in runs) * per_row
            receiver = statistics.median(r[1] for r in runs) * per_row
            both = statistics.median(r[0] + r[1] for r in runs) * per_row
            wall = statistics.median(r[2] for r in runs) * per_row
            sides[name, packing] = sender, receiver
            print(f"| {name} | {packing} | {len(dumps(item)):,} | {pickling * per_row:.2f} | {sender:.2f} "
                  f"| {receiver:.2f} | {both:.2f} | {wall:.2f} |")
    for packing in PACKINGS:
        encode = sides["driver -> encode", packing][1] + sides["encode -> score", packing][0]
        score = sides["encode -> score", packing][1] + sides["score -> driver", packing][0]
        trip = sum(sum(sides[name, packing]) for name in messages())
        print(f"{packing}: the encode stage pays {encode:.2f} CPU µs per row to receive and send "
              f"({encode / (10 * MODEL_STAGE_CPU_MS):.2f}% of {MODEL_STAGE_CPU_MS} ms), the score stage {score:.2f} "
              f"({score / (10 * MODEL_STAGE_CPU_MS):.2f}%); a batch's three messages {trip:.2f} in all, both sides")
    print(f"load average {os.getloadavg()[0]:.1f}")


def _same(a: Any, b: Any) -> bool:
    """Whether two messages hold the same values (tensors compared by dtype, shape and value)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


if __name__ == "__main__":
    main()
