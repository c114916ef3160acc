"""``python -m lightning_paro.convert SHARDED_DIR FULL_FILE``: consolidate a sharded PaRO checkpoint into one file.

The output is in Lightning's own format (as ``"ddp"`` writes it): ``LightningModule.load_from_checkpoint`` reads it
on one process, and ``Trainer(strategy="ddp").fit(..., ckpt_path=...)`` resumes from it.
"""

from __future__ import annotations

import argparse

from lightning_paro.strategy.checkpoint import convert_to_full


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lightning_paro.convert", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="sharded checkpoint directory (the one holding meta.pt and .metadata)")
    ap.add_argument("dst", help="output file, e.g. model.ckpt")
    ap.add_argument("--unsafe-load-meta", action="store_true",
                    help="read the trainer state with weights_only=False (only for checkpoints you trust)")
    args = ap.parse_args(argv)
    try:
        path = convert_to_full(args.src, args.dst, weights_only=not args.unsafe_load_meta)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
