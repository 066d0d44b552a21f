"""How far the kernel path's logits are from the core path's, next to how far MLX's own two
backends (the core path on the GPU and on the CPU) are from each other, for the tiny llama of
tests/test_kernels_cuda.py (bf16, and 4-bit g64), teacher-forced on the GPU core path's greedy
tokens. Relative to the largest logit, as the CUDA tests measure.

    python3 scripts/device/kernel_agreement.py [STEPS]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import mlx_omnia

_ENGINE_FIRST = mlx_omnia.runtime_info
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from tests.fixtures.tiny import write_tiny_llama  # noqa: E402

from mlx_omnia import load  # noqa: E402


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    gpu = mx.default_device()
    path = write_tiny_llama(Path(tempfile.mkdtemp()) / "m", hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    for quantize in (None, {"bits": 4, "group_size": 64}):
        fast = load(str(path), dtype="bfloat16", quantize=quantize)
        os.environ["OMNIA_REFERENCE_KERNELS"] = "1"
        ref = load(str(path), dtype="bfloat16", quantize=quantize)
        del os.environ["OMNIA_REFERENCE_KERNELS"]
        mx.set_default_device(mx.cpu)
        cpu = load(str(path), dtype="bfloat16", quantize=quantize)
        mx.set_default_device(gpu)
        print(f"== {quantize}: {sorted(set(fast.bindings().values()))} / "
              f"{sorted(set(ref.bindings().values()))}")
        ids = fast.encode("the quick brown fox jumps over")
        a, b = fast.decoding(), ref.decoding()
        mx.set_default_device(mx.cpu)
        c = cpu.decoding()
        lc = c.feed(ids)
        mx.eval(lc, c.state())
        mx.set_default_device(gpu)
        la, lb = a.feed(ids), b.feed(ids)
        worst = [0.0, 0.0, 0.0]
        for step in range(steps):
            mx.eval(la, lb, a.state(), b.state())
            fa, fb, fc = (np.array(x[-1].astype(mx.float32)) for x in (la, lb, lc))
            errs = (rel(fa, fb), rel(fc, fb), rel(fa, fc))
            worst = [max(w, e) for w, e in zip(worst, errs, strict=True)]
            if step < 8 or step % 8 == 0:
                print(f"   step {step:3d}  kernel-core {errs[0]:.4f}  cpu-gpu core {errs[1]:.4f}"
                      f"  kernel-cpu {errs[2]:.4f}  max|logit| {np.abs(fb).max():.3f}")
            token = int(fb.argmax())
            la, lb = a.feed([token]), b.feed([token])
            mx.set_default_device(mx.cpu)
            lc = c.feed([token])
            mx.eval(lc, c.state())
            mx.set_default_device(gpu)
        print(f"   worst over {steps}: kernel-core {worst[0]:.4f}  cpu-gpu core {worst[1]:.4f}"
              f"  kernel-cpu {worst[2]:.4f}")


if __name__ == "__main__":
    main()
