from __future__ import annotations

import os
from pathlib import Path

import pytest

# Under pytest-xdist (the CUDA tests on the lent GPU: scripts/device/run.sh cuda-tests), each
# worker keeps its own MLX kernel cache, OMNIA_TEST_PTX_CACHE/<worker>: MLX writes a cached
# kernel in place, so two
# processes sharing one directory could load a file the other is still writing. Set before any
# kernel is compiled (MLX reads it at its first compile).
if os.environ.get("OMNIA_TEST_PTX_CACHE") and os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["MLX_PTX_CACHE_DIR"] = os.path.join(
        os.environ["OMNIA_TEST_PTX_CACHE"], os.environ["PYTEST_XDIST_WORKER"]
    )

# Servers started by tests keep their prefix cache's disk tier in a directory of this session,
# never in the user's cache (subprocess servers inherit it).
if "OMNIA_PREFIX_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["OMNIA_PREFIX_DIR"] = tempfile.mkdtemp(prefix="omnia-prefix-")
    atexit.register(shutil.rmtree, os.environ["OMNIA_PREFIX_DIR"], True)

# The engine first: it loads the system OpenBLAS before anything imports mlx.core
# (engine/blas.py), as a user's `import mlx_omnia` does; a test module importing mlx.core
# first would leave the whole session on MLX's reference BLAS.
import mlx_omnia.engine  # noqa: F401  # pyright: ignore[reportUnusedImport]
from tests.fixtures.scripted_qwen3 import write_scripted_qwen3
from tests.fixtures.tiny import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama checkpoint (HF layout) shared by the session; do not modify it."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def scripted_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scripted qwen3 that thinks (tests/fixtures/scripted_qwen3.py), served under its
    directory's name `scripted-qwen3`; do not modify it."""
    return write_scripted_qwen3(tmp_path_factory.mktemp("models") / "scripted-qwen3")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct GGUF), loaded once per session."""
    from mlx_omnia import load

    return load()
