"""Packaging promises: lazy top-level import, the public names, the signature."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_importing_the_package_does_not_import_mlx() -> None:
    code = "import sys, mlx_omnia; print('mlx.core' in sys.modules, 'mlx_omnia.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_api_names() -> None:
    import mlx_omnia

    for name in ("load", "Chat", "ChatMessage", "GenerationOptions", "Piece", "Completion", "Model"):
        assert getattr(mlx_omnia, name) is not None


def test_tiny_model_declares_its_signature(tiny_llama_dir) -> None:  # type: ignore[no-untyped-def]
    from mlx_omnia import load

    model = load(tiny_llama_dir)
    sig = model.signature
    assert sig.inputs == frozenset({"text"})
    assert sig.outputs == frozenset({"text"})
    assert {"max_tokens", "temperature", "stop", "seed", "logit_bias"} <= sig.options.keys()
    assert sig.context_length == 256
    # Every layer declaration is bound, and on the CPU to the core (reference) implementation.
    bound = model.bindings()
    assert bound and set(bound.values()) == {"core"}
    assert "model.layers.0.self_attn.q_proj" in bound


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS preload is Linux-only")
def test_importing_mlx_first_warns_about_the_reference_blas() -> None:
    """MLX imported before the engine keeps the reference BLAS it ships (float32 prefill ~20x
    slower on the CPU): the engine says so, and how to avoid it, when an OpenBLAS is there."""
    import ctypes.util

    if ctypes.util.find_library("openblas") is None:
        pytest.fail("no OpenBLAS on this machine (apt-get install libopenblas0-pthread)")

    def warnings_of(code: str, **env: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, **env},
        ).stderr

    late = warnings_of("import mlx.core; import mlx_omnia.engine")
    assert "RuntimeWarning" in late and "Import mlx_omnia before mlx" in late
    assert "LD_PRELOAD=" in late
    assert "RuntimeWarning" not in warnings_of("import mlx_omnia.engine; import mlx.core")
    assert "RuntimeWarning" not in warnings_of(
        "import mlx.core; import mlx_omnia.engine", OMNIA_BLAS="0"
    )


STOP_PROBE = """
import ctypes, os
import mlx_omnia.engine
from mlx_omnia.engine import blas
import mlx.core as mx
a = mx.random.normal((512, 512))
mx.eval(a @ a)
lib = ctypes.CDLL(blas.loaded)
before = len(os.listdir("/proc/self/task"))
blas.stop_threads(lib)
print(lib.openblas_get_num_threads(), before, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS preload is Linux-only")
def test_openblas_workers_stop_before_its_destructor_can_hang() -> None:
    """OpenBLAS 0.3.21's exit-time join can wait forever on a worker that lost its wake-up
    (`python -m mlx_omnia` hung ~1 run in 10): the engine stops the workers itself at exit
    (`blas.stop_threads`, registered by the preload). After it, the process has one thread
    fewer per worker, and it exits."""
    import ctypes.util

    if ctypes.util.find_library("openblas") is None:
        pytest.fail("no OpenBLAS on this machine (apt-get install libopenblas0-pthread)")
    out = subprocess.run([sys.executable, "-c", STOP_PROBE], capture_output=True, text=True,
                         check=True, timeout=120)
    workers, before, after = (int(v) for v in out.stdout.split())
    assert before - after == workers - 1, out.stdout


JEMALLOC_PROBE = (
    "import os, sys\n"
    "print('start', os.getpid(), flush=True)\n"
    "from mlx_omnia.allocator import loaded, reexec_with_jemalloc\n"
    "reexec_with_jemalloc()\n"
    "print('malloc', loaded(), flush=True)\n"
)


def _run_probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LD_PRELOAD", "OMNIA_JEMALLOC", "OMNIA_JEMALLOC_REEXECUTED")}
    out = subprocess.run([sys.executable, "-c", JEMALLOC_PROBE], capture_output=True, text=True,
                         check=True, env={**clean, **env})
    return out.stdout.splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the jemalloc preload is Linux-only")
def test_programs_start_again_once_with_jemalloc_preloaded() -> None:
    """`reexec_with_jemalloc` (called by omnia-server and `python -m mlx_omnia` when started as
    programs) starts the same program again in the same process with the system's jemalloc in
    LD_PRELOAD, once; OMNIA_JEMALLOC=0 or a missing file keeps the system malloc."""
    import ctypes.util

    if ctypes.util.find_library("jemalloc") is None:
        pytest.fail("no jemalloc on this machine (apt-get install libjemalloc2)")
    lines = _run_probe()
    assert len(lines) == 3 and lines[0] == lines[1], lines  # two starts, one pid
    assert lines[2].startswith("malloc /") and "libjemalloc" in lines[2], lines
    assert _run_probe(OMNIA_JEMALLOC="0")[1:] == ["malloc None"]
    assert _run_probe(OMNIA_JEMALLOC="/nonexistent/libjemalloc.so.2")[1:] == ["malloc None"]
    preloaded = _run_probe(LD_PRELOAD=lines[2].split(" ", 1)[1])
    assert len(preloaded) == 2 and "libjemalloc" in preloaded[1]  # already there: no new start
