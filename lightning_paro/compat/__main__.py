"""``python -m lightning_paro.compat``: the private torch and Lightning APIs the package relies on, and whether the
installed versions have them (exit code 1 when one is missing)."""

from lightning_paro.compat import main

raise SystemExit(main())
