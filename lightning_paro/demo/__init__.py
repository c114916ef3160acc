"""The demo: a byte-level GPT on the standard library's source, run through the command line (``python -m lightning_paro.demo``)."""
