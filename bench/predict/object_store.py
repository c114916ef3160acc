"""A local HTTP object store with a fixed latency per request, for latency-bound read-path benchmarks.

``python object_store.py --latency-ms 30`` listens on 127.0.0.1 (a free port), prints ``PORT <n>``
and serves ``GET /obj/<i>``: a deterministic JSON record of ~1 KiB for row ``i``, after sleeping
the latency; ``GET /doc/<i>``: a longer document (``document``), zlib-compressed, as a store of compressed
records holds it. Each request runs in its own thread, like a remote store serving many clients.
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WORDS = [f"w{i}" for i in range(5000)]


def record(index: int) -> bytes:
    rng = random.Random(index)
    text = " ".join(rng.choice(WORDS) for _ in range(150))
    return json.dumps({"id": index, "text": text}).encode()


def document(index: int, words: int = 600) -> bytes:
    """A compressed JSON document of ``words`` words of mixed case and punctuation (~4 KiB before compression)."""
    rng = random.Random(index)
    parts = []
    for _ in range(words):
        word = rng.choice(WORDS)
        parts.append(word.upper() if rng.random() < 0.1 else word)
        if rng.random() < 0.08:
            parts.append(rng.choice([",", ".", ";", "!"]))
    return zlib.compress(json.dumps({"id": index, "title": f"doc {index}", "body": " ".join(parts)}).encode(), 6)


_DOCUMENTS: dict = {}


class Handler(BaseHTTPRequestHandler):
    latency_s = 0.03
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        time.sleep(self.latency_s)
        try:
            kind, index = self.path.rsplit("/", 2)[1:]
            index = int(index)
        except ValueError:
            self.send_error(404)
            return
        if kind == "doc":  # stored objects: made once, then served as they are
            body = _DOCUMENTS.get(index)
            if body is None:
                body = _DOCUMENTS[index] = document(index)
        else:
            body = record(index)
        self.send_response(200)
        self.send_header("Content-Type", "application/json" if kind == "obj" else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Server(ThreadingHTTPServer):
    # the listen backlog must be set before the socket listens: with the default of 5, bursts of
    # concurrent connections overflow it and clients wait for a SYN retransmission (1 s)
    request_queue_size = 1024
    daemon_threads = True


class ObjectStore:
    """Starts the store in its own process on 127.0.0.1 and stops it on exit."""

    def __init__(self, latency_ms: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--latency-ms", str(latency_ms)],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"object store did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def __enter__(self) -> "ObjectStore":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency-ms", type=float, default=30.0)
    args = parser.parse_args()
    Handler.latency_s = args.latency_ms / 1000
    server = _Server(("127.0.0.1", 0), Handler)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
