"""Packaging promises: lazy top-level import, the public names, the signature."""

from __future__ import annotations

import subprocess
import sys


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
    assert {"max_tokens", "temperature", "stop", "seed", "logit_bias"} <= sig.options
    assert sig.context_length == 256
    # Every layer declaration is bound, and on the CPU to the core (reference) implementation.
    bound = model.bindings()
    assert bound and set(bound.values()) == {"core"}
    assert "model.layers.0.self_attn.q_proj" in bound
