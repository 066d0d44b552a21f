"""GPU time per kernel of one engine decode step (a bench shape cut to a few layers) under ncu.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        python3 scripts/device/kernel_times.py run bf16|q4 [SHAPE [LAYERS]] > ncu.csv
    python3 scripts/device/kernel_times.py report ncu.csv [LAYERS [FULL_LAYERS]]

SHAPE defaults to qwen3-4b and LAYERS to 2; q4 is affine 4-bit g64, written quantized (a MoE
shape's bf16 stacks need not be held)."""

from __future__ import annotations

import csv
import sys
import tempfile
from pathlib import Path

LAYERS = 2


def run(fmt: str, shape: str = "qwen3-4b", layers: int = LAYERS) -> None:
    import mlx.core as mx

    import mlx_omnia
    from mlx_omnia.bench import shapes

    short = f"{shape}-short"
    shapes.SHAPES[short] = dict(shapes.SHAPES[shape], num_hidden_layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        written = None if fmt == "bf16" else (4, 64)
        path = shapes.build_checkpoint(short, Path(tmp) / "m", dtype="bfloat16", quantize=written)
        model = mlx_omnia.load(str(path), dtype="bfloat16")
        print(sorted(set(model.bindings().values())), file=sys.stderr)
        marker = mx.fast.cuda_kernel(name="probe_marker", input_names=["x"], output_names=["y"],
                                     source="y[0] = x[0];")
        seq = model.decoding()
        out = seq.feed(list(range(1, 513)))
        mx.eval(out, seq.state())
        for t in range(4):
            mx.eval(seq.feed([7 + t]), seq.state())
        x = mx.zeros((1,))
        mx.eval(marker(inputs=[x], output_shapes=[(1,)], output_dtypes=[mx.float32],
                       grid=(1, 1, 1), threadgroup=(1, 1, 1))[0])
        mx.eval(seq.feed([99]), seq.state())
        mx.eval(marker(inputs=[x], output_shapes=[(1,)], output_dtypes=[mx.float32],
                       grid=(1, 1, 1), threadgroup=(1, 1, 1))[0])


def report(path: str, layers: int = LAYERS, full: int | None = None) -> None:
    """Kernel times of the step between the last two markers, summed by kernel name; with
    `full` (the model's real layer count), the step's kernel time extrapolated to it: kernels
    that ran a multiple of `layers` times are per-layer work, the rest run once a token."""
    rows = list(csv.reader(line for line in Path(path).read_text().splitlines() if line.startswith('"')))
    head = rows[0]
    ki, vi, ui = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    seq = [(r[ki], float(r[vi].replace(",", "")) * scale.get(r[ui], 1.0)) for r in rows[1:]]
    marks = [i for i, (n, _) in enumerate(seq) if "probe_marker" in n]
    part = seq[marks[-2] + 1 : marks[-1]]
    total = sum(t for _, t in part)
    print(f"== {Path(path).name}: one decode step, {layers} layers + head: {len(part)} kernels, "
          f"{total:.1f} us")
    agg: dict[str, list[float]] = {}
    for n, t in part:
        agg.setdefault(n.split("(")[0][:160], []).append(t)
    for n, ts in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(ts):8.1f} us {len(ts):3d}x  {n}")
    if full:
        per_layer = sum(sum(ts) for ts in agg.values() if len(ts) % layers == 0) / layers
        once = sum(sum(ts) for ts in agg.values() if len(ts) % layers != 0)
        launches = sum(len(ts) for ts in agg.values() if len(ts) % layers == 0) / layers
        print(f"  per layer {per_layer:.1f} us ({launches:g} launches); at {full} layers: "
              f"{per_layer * full + once:.1f} us a token of kernel time "
              f"({launches * full + sum(1 for ts in agg.values() if len(ts) % layers):g} launches)")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], *sys.argv[3:4], *(int(a) for a in sys.argv[4:5]))
    else:
        report(sys.argv[2], *(int(a) for a in sys.argv[3:5]))
