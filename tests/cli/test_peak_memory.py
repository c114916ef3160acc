"""The bench command's peak-memory reading on the CPU: with the mmap threshold fixed, a freed tensor leaves the
resident set, the high-water mark keeps it, and a reset starts a new mark at what is resident now."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import torch
    from lightning_paro.cli.peak_memory import fix_mmap_threshold, peak_bytes, reset_peak, resident_bytes

    cpu = torch.device("cpu")
    assert fix_mmap_threshold()
    reset_peak(cpu)
    before = resident_bytes()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    held = resident_bytes()
    del big
    after = resident_bytes()
    peak = peak_bytes(cpu)
    reset_peak(cpu)
    fresh = peak_bytes(cpu)
    print(before, held, after, peak, fresh)
""")


@pytest.mark.timeout(60)
def test_a_freed_tensor_leaves_the_resident_set_and_the_peak_keeps_it():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    before, held, after, peak, fresh = map(int, proc.stdout.split())
    mib = 2**20
    assert held - before >= 60 * mib          # the tensor is resident while alive
    assert held - after >= 60 * mib           # and leaves the resident set when freed
    assert peak >= held - mib                 # the high-water mark keeps it (the kernel's counters lag a little)
    assert fresh < peak - 60 * mib            # a reset starts from what is resident now
