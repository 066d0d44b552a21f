"""An optimized BLAS for MLX's Linux CPU backend, when the system has one.

MLX's Linux CPU wheel links the reference BLAS (a few GFLOP/s). Loading the system OpenBLAS into
the global symbol scope *before* `mlx.core` makes MLX's float32 matmuls resolve to it: about 2x
faster decode and 10x faster prefill here (Debian/Ubuntu: `apt-get install libopenblas0-pthread`).
Set OMNIA_BLAS=0 to keep the reference BLAS; OMNIA_BLAS=/path/to/libopenblas.so picks a file.
Importing this module preloads (the engine imports it first); it must not import MLX."""

from __future__ import annotations

import atexit
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
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded = name
        atexit.register(stop_threads, lib)
        return loaded
    return None


# cblas_sgemm(order, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
_SGEMM_ARGS = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                    ctypes.c_void_p, ctypes.c_int]


def stop_threads(lib: ctypes.CDLL) -> None:
    """Stop OpenBLAS's worker threads at interpreter exit, while it is safe to.

    OpenBLAS 0.3.21 (Debian 12's) can hang at process exit: its destructor joins the worker
    threads after posting a wake-up, but a worker that found no work ~2^28 cycles after its last
    job checks the queue outside the lock, then marks itself asleep and waits; a wake-up posted
    in between is lost and the join waits forever. `python -m mlx_omnia` exits just after its
    last matmul and hung about one run in ten (2026-12-05). Here, one multithreaded product
    makes every worker take a job (so each restarts its spin, far from going to sleep), then
    the shutdown runs at once; the destructor later finds the threads gone."""
    try:
        sgemm, shutdown = lib.cblas_sgemm, lib.blas_thread_shutdown_
    except AttributeError:  # not an OpenBLAS with a thread server: nothing to stop
        return
    n = 256
    a = (ctypes.c_float * (n * n))()
    c = (ctypes.c_float * (n * n))()
    sgemm.argtypes, sgemm.restype = _SGEMM_ARGS, None
    shutdown.argtypes, shutdown.restype = [], ctypes.c_int
    sgemm(101, 111, 111, n, n, n, 1.0, a, n, a, n, 0.0, c, n)  # row-major, no transposes
    shutdown()


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


def note(on_cpu: bool) -> str | None:
    """What a Linux CPU process loses without an optimized BLAS, and how to get it (None when it
    has one, runs elsewhere, or OMNIA_BLAS=0 chose the reference BLAS). Read again on each call:
    an OpenBLAS installed after the start is named, and only a restart loads it."""
    if loaded is not None or not on_cpu or not sys.platform.startswith("linux"):
        return None
    if os.environ.get("OMNIA_BLAS", "") == "0" or too_late:
        return None
    cost = "float32 matmuls run on MLX's reference BLAS: ~2x slower decode, ~10x slower prefill"
    if ctypes.util.find_library("openblas") is not None:
        return f"an OpenBLAS is installed but this process started without it ({cost}); restart it"
    return (f"no optimized BLAS ({cost}); install one (Debian/Ubuntu: apt-get install "
            "libopenblas0-pthread, as root or with sudo) and restart")


preload()  # at import: the engine package imports this module before any other
