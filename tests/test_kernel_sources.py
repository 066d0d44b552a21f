"""The CUDA kernels the engine generates, pinned byte for byte (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# `python scripts/nvrtc_check.py --digest` at the commit that last changed a kernel on purpose.
PINNED = "986 kernels sha256 170bb2a5d75667311599668f2f5e5df6161c16544693c2323f275652406263f8"


def test_generated_cuda_kernels_are_byte_identical_to_the_pinned_ones() -> None:
    """Every kernel's name, body, header and launch geometry, for each spec nvrtc_check.py
    enumerates, hashes to PINNED: same bytes, same machine code, checked without a GPU. To change
    a kernel on purpose, diff `nvrtc_check.py --dump DIR` before and after, check it on a GPU
    (the CUDA suite), and set PINNED to the new `--digest`, saying why in the commit."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "nvrtc_check.py"), "--digest"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == PINNED
