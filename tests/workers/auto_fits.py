"""The two-process ``sharding="auto"`` workers in one launch (2 groups of 1), one after another in the same
processes: ``switch_peak.py`` (its fits "fits" and "short"), ``auto_record.py`` ("timed" and "deterministic"; last
of the Lightning fits, as its deterministic fit turns torch's deterministic algorithms on) and ``replan_agree.py``
(a JobReplanner driven by hand over the process group the fits left). Each writes its own files under OUT, as when
launched alone.

argv: output directory.
"""

import runpy
import sys
from pathlib import Path

out = Path(sys.argv[1])
for script, sub in (("switch_peak.py", "switch_peak"), ("auto_record.py", "auto_record"),
                    ("replan_agree.py", "replan_agree")):
    (out / sub).mkdir(parents=True, exist_ok=True)
    sys.argv = [script, str(out / sub)]
    runpy.run_path(str(Path(__file__).parent / script), run_name="__main__")
