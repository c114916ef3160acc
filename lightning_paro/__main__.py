"""``python -m lightning_paro fit|predict|bench [KEY=VALUE ...]``: the package's command line."""

import sys

from lightning_paro.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
