"""GPU time of every qmv launch candidate on the Qwen3-4B layer shapes, under ncu (caches
flushed before each kernel, so weights stream from memory as in a decode step).

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        python3 scripts/device/qmv_sweep.py run sweep.json > sweep.csv
    python3 scripts/device/qmv_sweep.py report sweep.csv sweep.json"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

HIDDEN, INTER, HEADS, KV, HEAD_DIM, VOCAB = 2560, 9728, 32, 8, 128, 151936

# name -> (rows, k, gated, norm, residual)
SHAPES = {
    "qkv": ((HEADS * HEAD_DIM, KV * HEAD_DIM, KV * HEAD_DIM), HIDDEN, False, True, False),
    "o": ((HIDDEN,), HEADS * HEAD_DIM, False, False, True),
    "gate_up": ((INTER, INTER), HIDDEN, True, True, False),
    "down": ((HIDDEN,), INTER, False, False, True),
    "head": ((VOCAB,), HIDDEN, False, True, False),
}


def run(out: str) -> None:
    import mlx.core as mx

    from mlx_omnia.engine.core.kernels.qmv.cuda import CANDIDATES, QmvSpec, launcher, spec_fits

    meta: dict[str, dict[str, object]] = {}
    for fmt in os.environ.get("SWEEP_FMTS", "bf16,q4").split(","):
        bits, group = (None, None) if fmt == "bf16" else (4, 64)
        for shape, (rows, k, gated, norm, residual) in SHAPES.items():
            mats: list[list[mx.array]] = []
            for n in rows:
                w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
                if bits is None:
                    mats.append([w])
                else:
                    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
                    mats.append([wq, s, b])
            x = mx.random.normal((1, 1, k)).astype(mx.bfloat16)
            inputs = [x, *[a for m in mats for a in m]]
            if norm:
                inputs.append(mx.ones((k,), mx.bfloat16))
            if residual:
                inputs.append(mx.zeros((1, 1, rows[0]), mx.bfloat16))
            mx.eval(inputs)
            nbytes = sum(a.nbytes for m in mats for a in m)
            base = QmvSpec(dtype=mx.bfloat16, k=k, rows=rows, bits=bits, group_size=group,
                           norm_eps=1e-6 if norm else None, gate="silu" if gated else None,
                           residual=residual)
            for launch in (None,) if os.environ.get("SWEEP_DEFAULTS") else (None, *CANDIDATES):
                spec = replace(base, launch=launch)
                if not spec_fits(spec):
                    continue
                call = launcher(spec, (1, 1))
                for _ in range(1 if os.environ.get("SWEEP_DEFAULTS") else 3):
                    mx.eval(call(inputs))
                was_default = bool(meta.get(spec.name(), {}).get("default", False))
                meta[spec.name()] = {
                    "fmt": fmt, "shape": shape, "bytes": nbytes,
                    "default": launch is None or was_default, "launch": f"{spec.config}",
                }
            del mats, inputs
    Path(out).write_text(json.dumps(meta, indent=1))


def report(path: str, meta_path: str) -> None:
    meta = json.loads(Path(meta_path).read_text())
    rows = list(csv.reader(line for line in Path(path).read_text().splitlines() if line.startswith('"')))
    head = rows[0]
    ki, vi, ui = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    times: dict[str, list[float]] = {}
    for r in rows[1:]:
        m = re.search(r"omnia_qmv_\w+", r[ki])
        if m:
            name = m.group(0)
            times.setdefault(name, []).append(float(r[vi].replace(",", "")) * scale.get(r[ui], 1))
    table: dict[tuple[str, str], list[tuple[float, str, bool]]] = {}
    for name, ts in times.items():
        info = meta.get(name)
        if info is None:
            continue
        t = sorted(ts)[len(ts) // 2]
        table.setdefault((info["fmt"], info["shape"]), []).append(
            (t, f"{info['launch']} {info['bytes'] / t / 1e6:6.2f} TB/s", info["default"]))
    for (fmt, shape), entries in sorted(table.items()):
        print(f"== {fmt} {shape}")
        for t, text, default in sorted(entries):
            print(f"  {t:8.2f} us  {text}{'  <- default' if default else ''}")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        report(sys.argv[2], sys.argv[3])
