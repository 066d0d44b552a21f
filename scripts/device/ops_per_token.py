"""Operations in one decode step (H200 probe for issue 5): the primitives MLX evaluates for one
token, by kind, for the engine's step (compiled and eager) and mlx-lm's, from mx.export_to_dot.

    python3 scripts/device/ops_per_token.py SHAPE [QUANT_BITS [LAYERS]]     # e.g. qwen3-4b 4
"""

from __future__ import annotations

import collections
import re
import sys
import tempfile
import time
from pathlib import Path

import mlx_omnia

_ENGINE_FIRST = mlx_omnia.runtime_info
import mlx.core as mx  # noqa: E402
from host_overhead import checkpoint, load_arm  # noqa: E402  (scripts/device/ is on the path)

from mlx_omnia.bench import shapes  # noqa: E402


def count(label: str, out: mx.array, layers: int) -> None:
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        text = Path(f.name).read_text()
    kinds = collections.Counter(re.findall(r'\[label ="([^"]+)"', text))
    total = sum(kinds.values())
    top = ", ".join(f"{k} {v}" for k, v in kinds.most_common(14))
    print(f"   {label:<14} {total:5d} primitives ({total / layers:5.1f} per layer): {top}", flush=True)


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b"
    bits = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "0" else None
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else None
    name = shape
    if layers is not None:
        name = f"{shape}-{layers}"
        shapes.SHAPES[name] = dict(shapes.SHAPES[shape], num_hidden_layers=layers)
    n_layers = int(shapes.SHAPES[name]["num_hidden_layers"])
    print(f"== {name} {'bf16' if bits is None else f'{bits}-bit'} {mx.default_device()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path, quant = checkpoint(name, Path(tmp), bits)
        for arm_name in ("omnia", "omnia-eager", "mlx-lm"):
            arm = load_arm(arm_name, path, quant)
            if arm is None:
                continue
            feed = arm.new_sequence()
            mx.eval(*feed(list(range(1, 65))))
            for t in range(3):
                mx.eval(*feed([3 + t]))
            start = time.perf_counter()
            logits, _ = feed([5])
            built = time.perf_counter() - start
            count(arm_name, logits, n_layers)
            print(f"   {'':<14} graph built in {built * 1e6:.0f} us (python + compile replay)", flush=True)
            mx.eval(logits)
            del arm, feed, logits
            mx.clear_cache()


if __name__ == "__main__":
    main()
