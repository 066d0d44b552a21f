"""The CUDA kernels the engine generates, pinned byte for byte (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlx_omnia.engine.core.kernels.cuda_common import render

ROOT = Path(__file__).resolve().parent.parent

# `python scripts/nvrtc_check.py --digest` at the commit that last changed a kernel on purpose.
PINNED = "1320 kernels sha256 b5a1b26f1d625188bdeb713bb27a1ad8e390364b4b2a80162c4b0e96072c9f03"


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


ROUTE = {"T": "__half", "E": 8, "TOPK": 2, "ORDER": 0, "NORMALIZE": "true"}


def test_render_puts_each_value_where_its_placeholder_stands() -> None:
    assert render("moe/route.cu", **ROUTE) == (
        "omnia::route<__half, 8, 2, 0, true>(logits, weights, ids);\n"
    )


def test_render_refuses_a_missing_or_an_unused_value() -> None:
    with pytest.raises(ValueError, match="placeholders"):
        render("moe/route.cu", **{k: v for k, v in ROUTE.items() if k != "E"})
    with pytest.raises(ValueError, match="placeholders"):
        render("moe/route.cu", **ROUTE, WARPS=8)


def test_render_takes_whole_lines_only_where_a_placeholder_stands_alone() -> None:
    assert render("moe/experts_chain.cu", T="__half", CHAIN="") == (
        "__half* mid = reinterpret_cast<__half*>(const_cast<float*>(scratch));\n"
    )
    with pytest.raises(ValueError, match="whole lines"):
        render("moe/experts_chain.cu", T="__half", CHAIN="return;")
    with pytest.raises(ValueError, match="one line"):
        render("moe/route.cu", **{**ROUTE, "T": "__half\n"})
