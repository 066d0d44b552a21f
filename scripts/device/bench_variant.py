"""omnia-bench with a kernel_ab.py variant applied to the whole process (its kernels built under
the variant's patch; the mlx-lm arm is untouched), so that a variant measured in an A/B can be
benched before it goes into the engine:

    python3 scripts/device/bench_variant.py VARIANT|none interleaved --model ... (omnia-bench's)

(V1+V2: both patches.)"""

from __future__ import annotations

import runpy
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_ab import combined


def main() -> None:
    variant = sys.argv[1]
    sys.argv = ["omnia-bench", *sys.argv[2:]]
    print(f"[bench_variant] omnia's kernels built with: {variant}")
    with combined(variant)() if variant != "none" else nullcontext():
        runpy.run_module("mlx_omnia.bench.main", run_name="__main__")


if __name__ == "__main__":
    main()
