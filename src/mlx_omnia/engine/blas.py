"""An optimized BLAS for MLX's Linux CPU backend, when the system has one.

MLX's Linux CPU wheel links the reference BLAS (a few GFLOP/s). Loading the system OpenBLAS into
the global symbol scope *before* `mlx.core` makes MLX's float32 matmuls resolve to it: about 2x
faster decode and 10x faster prefill here (Debian/Ubuntu: `apt-get install libopenblas0-pthread`).
Set OMNIA_BLAS=0 to keep the reference BLAS; OMNIA_BLAS=/path/to/libopenblas.so picks a file.
This module must not import MLX."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

CANDIDATES = ("libopenblas.so.0", "libopenblas.so")

loaded: str | None = None
too_late = False  # mlx.core was imported before the engine: MLX keeps the BLAS it ships


def preload() -> str | None:
    """Load an OpenBLAS globally if on Linux, not disabled, and MLX is not imported yet."""
    global loaded, too_late
    choice = os.environ.get("OMNIA_BLAS", "")
    if loaded is not None or choice == "0" or not sys.platform.startswith("linux"):
        return loaded
    if "mlx.core" in sys.modules:
        too_late = True  # MLX already bound its BLAS symbols (Python loads with RTLD_NOW)
        return None
    names = [choice] if choice else [*CANDIDATES, ctypes.util.find_library("openblas") or ""]
    for name in names:
        if not name:
            continue
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded = name
        return loaded
    return None


def late_warning() -> str | None:
    """The warning to give when mlx.core came first on a Linux CPU and an OpenBLAS is there to
    be used (None otherwise): float32 matmuls then run on the reference BLAS MLX ships."""
    if not too_late or os.environ.get("OMNIA_BLAS", "") == "0":
        return None
    found = ctypes.util.find_library("openblas")
    if found is None:
        return None
    return (
        f"mlx.core was imported before mlx_omnia, so MLX's CPU backend keeps the reference BLAS "
        f"it ships and float32 matmuls run ~20x slower than with the system {found}. Import "
        f"mlx_omnia before mlx, or start Python with LD_PRELOAD={found}; OMNIA_BLAS=0 silences "
        f"this."
    )
