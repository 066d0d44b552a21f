"""H200 probe: dispatch costs, kernel correctness and bandwidth, and a prototype decode step.

Not part of the package or the tests: a development measurement, run through the device tool:
    bash .device-wheels/install.sh && PYTHONPATH=$PWD/src python3 scripts/h200_probe.py [parts]
Parts: dispatch, kernels, step (default: all). Prints a short table at the end of each part."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.kernels.attention_step.cuda import AttentionStepSpec
from mlx_omnia.engine.core.kernels.head_norm_rope.cuda import HeadNormRopeSpec
from mlx_omnia.engine.core.kernels.qmv.cuda import QmvSpec, spec_fits

RESULTS: dict[str, Any] = {}
OUT = os.environ.get("OUT", "/tmp")


def timed(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
def dispatch(n: int = 400) -> dict[str, float]:
    tiny = mx.fast.cuda_kernel(
        name="probe_tiny", input_names=["x"], output_names=["y"],
        source="unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 256) y[i] = x[i] + 1.0f;",
    )
    x0 = mx.zeros((256,), mx.float32)
    w = mx.ones((2560,), mx.bfloat16)
    h0 = mx.random.normal((1, 2560)).astype(mx.bfloat16)
    mx.eval(x0, w, h0)

    def chain_custom(x):
        for _ in range(n):
            x = tiny(inputs=[x], output_shapes=[(256,)], output_dtypes=[mx.float32],
                     grid=(256, 1, 1), threadgroup=(256, 1, 1))[0]
        return x

    def chain_norm(h):
        for _ in range(n):
            h = mx.fast.rms_norm(h, w, 1e-5)
        return h

    out: dict[str, float] = {}
    out["custom_build_us"] = timed(lambda: chain_custom(x0)) / n * 1e6
    out["custom_eager_us"] = timed(lambda: mx.eval(chain_custom(x0))) / n * 1e6
    cc = mx.compile(chain_custom)
    out["custom_compiled_us"] = timed(lambda: mx.eval(cc(x0))) / n * 1e6
    out["norm_build_us"] = timed(lambda: chain_norm(h0)) / n * 1e6
    out["norm_eager_us"] = timed(lambda: mx.eval(chain_norm(h0))) / n * 1e6
    cn = mx.compile(chain_norm)
    out["norm_compiled_us"] = timed(lambda: mx.eval(cn(h0))) / n * 1e6
    return out


def dispatch_sweep() -> None:
    rows = {}
    rows["default"] = dispatch()
    for ops in (8, 50, 120, 250):
        env = dict(os.environ, MLX_MAX_OPS_PER_BUFFER=str(ops))
        res = subprocess.run(
            [sys.executable, __file__, "dispatch-child"], env=env, capture_output=True, text=True,
            timeout=120,
        )
        try:
            rows[f"max_ops={ops}"] = json.loads(res.stdout.strip().splitlines()[-1])
        except Exception:  # noqa: BLE001
            rows[f"max_ops={ops}"] = {"error": res.stderr[-500:]}
    RESULTS["dispatch"] = rows
    print("\n== dispatch: microseconds per op (chain of 400) ==")
    keys = list(rows["default"].keys())
    print("setting".ljust(14) + "".join(k.ljust(20) for k in keys))
    for name, row in rows.items():
        print(name.ljust(14) + "".join(f"{row.get(k, float('nan')):<20.2f}" for k in keys))


# ---------------------------------------------------------------------------------------------
def reference_qmv(spec: QmvSpec, x: mx.array, segs: list[tuple[mx.array, ...]],
                  g: mx.array | None, res: mx.array | None) -> mx.array:
    h = x[None]
    if spec.norm_eps is not None:
        assert g is not None
        h = mx.fast.rms_norm(h, g, spec.norm_eps)
    outs = []
    for seg in segs:
        if spec.bits is None:
            outs.append(h @ seg[0].T)
        else:
            outs.append(mx.quantized_matmul(h, seg[0], seg[1], seg[2], transpose=True,
                                            group_size=spec.group_size, bits=spec.bits))
    if spec.gate == "silu":
        y = outs[0] * mx.sigmoid(outs[0]) * outs[1]
    elif spec.gate is not None:
        gg = outs[0]
        y = 0.5 * gg * (1.0 + mx.tanh(0.7978845608028654 * (gg + 0.044715 * gg * gg * gg))) * outs[1]
    else:
        y = mx.concatenate(outs, axis=-1)
    if res is not None:
        y = y + res
    return y[0]


def make_inputs(spec: QmvSpec, copies: int) -> list[tuple[list[mx.array], tuple]]:
    sets = []
    for _ in range(copies):
        segs = []
        flat: list[mx.array] = []
        for n in spec.rows:
            wd = (mx.random.normal((n, spec.k)) * 0.02).astype(spec.dtype)
            if spec.bits is None:
                seg = (wd,)
            else:
                q, s, b = mx.quantize(wd, group_size=spec.group_size, bits=spec.bits)
                seg = (q, s.astype(spec.dtype), b.astype(spec.dtype))
            segs.append(seg)
            flat.extend(seg)
        sets.append((segs, flat))
        mx.eval(flat)
    return sets


def kernels_part() -> None:
    shapes = [
        ("qkv+norm", dict(k=2560, rows=(4096, 1024, 1024), norm_eps=1e-6)),
        ("o+res", dict(k=4096, rows=(2560,), residual=True)),
        ("gateup+norm+silu", dict(k=2560, rows=(9728, 9728), norm_eps=1e-6, gate="silu")),
        ("down+res", dict(k=9728, rows=(2560,), residual=True)),
        ("lm_head+norm", dict(k=2560, rows=(151936,), norm_eps=1e-6)),
        ("gelu gate small", dict(k=576, rows=(1536, 1536), gate="gelu_tanh")),
        ("smollm qkv", dict(k=576, rows=(576, 192, 192), norm_eps=1e-5)),
    ]
    rows = []
    for fmt in ("bf16", "q4g64", "q8g64", "q4g32", "f16"):
        for label, kw in shapes:
            if fmt != "bf16" and label.startswith("gelu"):
                continue
            dtype = mx.float16 if fmt == "f16" else mx.bfloat16
            bits = {"q4g64": 4, "q8g64": 8, "q4g32": 4}.get(fmt)
            gs = {"q4g64": 64, "q8g64": 64, "q4g32": 32}.get(fmt)
            spec = QmvSpec(dtype=dtype, bits=bits, group_size=gs, **kw)
            if not spec_fits(spec):
                rows.append((fmt, label, "declined"))
                continue
            per_set = sum(spec.k * n for n in spec.rows) * (2 if bits is None else bits / 8 + 4 / spec.group_size)
            copies = max(1, min(12, int(math.ceil(400e6 / per_set))))
            if label.startswith("lm_head"):
                copies = 2
            sets = make_inputs(spec, copies)
            x = mx.random.normal((spec.k,)).astype(dtype)
            g = (1.0 + 0.1 * mx.random.normal((spec.k,))).astype(dtype) if spec.norm_eps else None
            res = mx.random.normal((spec.out_rows,)).astype(dtype) if spec.residual else None
            mx.eval(x, *(a for a in (g, res) if a is not None))

            def kin(flat):
                ins = [x, *flat]
                if g is not None:
                    ins.append(g)
                if res is not None:
                    ins.append(res)
                return ins

            # correctness against the core ops on fresh inputs
            errs = []
            exact = []
            for segs, flat in sets[:2]:
                got = spec.launch(kin(flat)).astype(mx.float32)
                ref = reference_qmv(spec, x, segs, g, res).astype(mx.float32)
                err = mx.max(mx.abs(got - ref)) / mx.maximum(mx.max(mx.abs(ref)), 1e-6)
                errs.append(err.item())
                exact.append(mx.mean((got == ref).astype(mx.float32)).item())
            reps = 48

            def run_kernel():
                outs = [spec.launch(kin(sets[i % copies][1])) for i in range(reps)]
                mx.eval(outs)

            def run_ref():
                outs = [reference_qmv(spec, x, sets[i % copies][0], g, res) for i in range(reps)]
                mx.eval(outs)

            tk = timed(run_kernel, 3) / reps
            tr = timed(run_ref, 3) / reps
            rows.append((fmt, label, f"err {max(errs):.2e} exact {min(exact):.3f}",
                         f"kernel {tk*1e6:8.1f} us {per_set/tk/1e9:7.0f} GB/s",
                         f"core {tr*1e6:8.1f} us {per_set/tr/1e9:7.0f} GB/s"))
            del sets
    RESULTS["kernels"] = rows
    print("\n== qmv kernels vs core ops (chains of 48 launches over rotating weights) ==")
    for r in rows:
        print(" | ".join(str(c) for c in r))


# ---------------------------------------------------------------------------------------------
class Layer:
    def __init__(self, quant: tuple[int, int] | None) -> None:
        d, h, hkv, hd, inter = 2560, 32, 8, 128, 9728
        self.quant = quant

        def lin(n, k):
            w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
            if quant is None:
                return (w,)
            q, s, b = mx.quantize(w, group_size=quant[1], bits=quant[0])
            return (q, s.astype(mx.bfloat16), b.astype(mx.bfloat16))

        self.q, self.k, self.v = lin(h * hd, d), lin(hkv * hd, d), lin(hkv * hd, d)
        self.o = lin(d, h * hd)
        self.gate, self.up, self.down = lin(inter, d), lin(inter, d), lin(d, inter)
        one = lambda n: (1.0 + 0.1 * mx.random.normal((n,))).astype(mx.bfloat16)  # noqa: E731
        self.ln1, self.ln2, self.qn, self.kn = one(d), one(d), one(hd), one(hd)
        mx.eval(self.__dict__)

    def mm(self, x, w):
        if self.quant is None:
            return x @ w[0].T
        return mx.quantized_matmul(x, *w, transpose=True, group_size=self.quant[1], bits=self.quant[0])


H, HKV, HD, DM = 32, 8, 128, 2560
INV_FREQ = mx.array([1.0 / (1e6 ** (2 * i / HD)) for i in range(HD // 2)], dtype=mx.float32)


def ref_layer(L: Layer, x, keys, values, off: int):
    h = mx.fast.rms_norm(x, L.ln1, 1e-6)
    q = L.mm(h, L.q).reshape(1, 1, H, HD)
    k = L.mm(h, L.k).reshape(1, 1, HKV, HD)
    v = L.mm(h, L.v).reshape(1, 1, HKV, HD)
    q = mx.fast.rms_norm(q, L.qn, 1e-6).swapaxes(1, 2)
    k = mx.fast.rms_norm(k, L.kn, 1e-6).swapaxes(1, 2)
    v = v.swapaxes(1, 2)
    q = mx.fast.rope(q, HD, traditional=False, base=1e6, scale=1.0, offset=off)
    k = mx.fast.rope(k, HD, traditional=False, base=1e6, scale=1.0, offset=off)
    keys[..., off : off + 1, :] = k
    values[..., off : off + 1, :] = v
    o = mx.fast.scaled_dot_product_attention(q, keys[..., : off + 1, :], values[..., : off + 1, :],
                                             scale=HD ** -0.5, mask=None)
    o = o.swapaxes(1, 2).reshape(1, 1, H * HD)
    h2 = x + L.mm(o, L.o)
    m = mx.fast.rms_norm(h2, L.ln2, 1e-6)
    g = L.mm(m, L.gate)
    return h2 + L.mm(g * mx.sigmoid(g) * L.mm(m, L.up), L.down), keys, values


def kernel_layer(L: Layer, x, keys, values, off: int, pos: mx.array, custom_attention: bool = True):
    bits, gs = (L.quant or (None, None))
    flat = lambda *ws: [a for w in ws for a in w]  # noqa: E731
    qkv_spec = QmvSpec(dtype=mx.bfloat16, k=DM, rows=(H * HD, HKV * HD, HKV * HD), bits=bits,
                       group_size=gs, norm_eps=1e-6)
    qkv = qkv_spec.launch([x.reshape(DM), *flat(L.q, L.k, L.v), L.ln1])
    rope = HeadNormRopeSpec(dtype=mx.bfloat16, n_heads=H, n_kv_heads=HKV, head_dim=HD,
                            q_eps=1e-6, k_eps=1e-6)
    q, k = rope.launch([qkv, L.qn, L.kn, INV_FREQ, pos])
    v = qkv[(H + HKV) * HD :]
    if custom_attention:
        spec = AttentionStepSpec(dtype=mx.bfloat16, n_heads=H, n_kv_heads=HKV, head_dim=HD,
                                 capacity=keys.shape[2], scale=HD ** -0.5)
        o = spec.launch(q, k, v, keys, values, pos)
    else:
        keys[..., off : off + 1, :] = k.reshape(1, HKV, 1, HD)
        values[..., off : off + 1, :] = v.reshape(1, HKV, 1, HD)
        o = mx.fast.scaled_dot_product_attention(q.reshape(1, H, 1, HD), keys[..., : off + 1, :],
                                                 values[..., : off + 1, :], scale=HD ** -0.5, mask=None)
    o_spec = QmvSpec(dtype=mx.bfloat16, k=H * HD, rows=(DM,), bits=bits, group_size=gs, residual=True)
    h2 = o_spec.launch([o.reshape(H * HD), *L.o, x.reshape(DM)])
    gu_spec = QmvSpec(dtype=mx.bfloat16, k=DM, rows=(9728, 9728), bits=bits, group_size=gs,
                      norm_eps=1e-6, gate="silu")
    a = gu_spec.launch([h2, *flat(L.gate, L.up), L.ln2])
    d_spec = QmvSpec(dtype=mx.bfloat16, k=9728, rows=(DM,), bits=bits, group_size=gs, residual=True)
    return d_spec.launch([a, *L.down, h2]).reshape(1, 1, DM), keys, values


KINDS = ("ref", "kernel_sdpa", "kernel")


def layer_fn(kind, L, x, kc, vc, off, pos):
    if kind == "ref":
        return ref_layer(L, x, kc, vc, off)
    return kernel_layer(L, x, kc, vc, off, pos, custom_attention=(kind == "kernel"))


def setup(quant, layers_n):
    mx.random.seed(0)
    layers = [Layer(quant) for _ in range(layers_n)]
    caches = [(mx.random.normal((1, HKV, 1024, HD)).astype(mx.bfloat16),
               mx.random.normal((1, HKV, 1024, HD)).astype(mx.bfloat16)) for _ in layers]
    x0 = mx.random.normal((1, 1, DM)).astype(mx.bfloat16)
    mx.eval(caches, x0)
    return layers, caches, x0


def step_part(layers_n: int = 36) -> None:
    out_rows = []
    off = 512
    pos = mx.array([off], dtype=mx.int32)
    for quant in (None, (4, 64)):
        layers, caches, x0 = setup(quant, layers_n)

        def run(kind: str):
            x = x0
            for i, L in enumerate(layers):
                kc, vc = caches[i]
                x, kc, vc = layer_fn(kind, L, x, kc, vc, off, pos)
                caches[i] = (kc, vc)
            return x

        def full(kind):
            y = run(kind)
            mx.eval(y, caches)
            return y

        outs = {kind: full(kind).astype(mx.float32) for kind in KINDS}
        res = {}
        for kind in KINDS[1:]:
            res[f"agree_{kind}"] = (mx.max(mx.abs(outs[kind] - outs["ref"])) / mx.max(mx.abs(outs["ref"]))).item()
        for kind in KINDS:
            res[f"{kind}_build_ms"] = timed(lambda: run(kind), 5) * 1e3
            res[f"{kind}_step_ms"] = timed(lambda: full(kind), 10) * 1e3

        def fn_for(kind):
            def fn(x, *flat_caches):
                outs = []
                for i, L in enumerate(layers):
                    kc, vc = flat_caches[2 * i], flat_caches[2 * i + 1]
                    x, kc, vc = layer_fn(kind, L, x, kc, vc, off, pos)
                    outs += [kc, vc]
                return [x, *outs] if kind != "kernel" else [x]
            return mx.compile(fn)

        for kind in KINDS:
            try:
                cf = fn_for(kind)
                flat_c = [a for c in caches for a in c]

                def call():
                    mx.eval(cf(x0, *flat_c))

                res[f"{kind}_compiled_ms"] = timed(call, 10) * 1e3
            except Exception as e:  # noqa: BLE001
                res[f"{kind}_compiled_ms"] = float("nan")
                print("compile failed", kind, repr(e)[:300])
        wbytes = sum(a.nbytes for L in layers for a in (*L.q, *L.k, *L.v, *L.o, *L.gate, *L.up, *L.down))
        res["weights_gb"] = wbytes / 1e9
        out_rows.append(("bf16" if quant is None else "q4g64", res))
        del layers, caches
    RESULTS["step"] = out_rows
    print(f"\n== prototype decode step, {layers_n} Qwen3-4B layers (no embed/lm_head), ctx 512 ==")
    for fmt, res in out_rows:
        print(fmt)
        for k, v in res.items():
            print(f"   {k:28s} {v:.3f}")


def ncu_child(fmt: str, layers_n: int = 2) -> None:
    quant = None if fmt == "bf16" else (4, 64)
    layers, caches, x0 = setup(quant, layers_n)
    off = 512
    pos = mx.array([off], dtype=mx.int32)
    marker = mx.fast.cuda_kernel(name="probe_marker", input_names=["x"], output_names=["y"],
                                 source="y[0] = x[0];")

    def mark():
        mx.eval(marker(inputs=[x0], output_shapes=[(1,)], output_dtypes=[mx.bfloat16],
                       grid=(1, 1, 1), threadgroup=(1, 1, 1))[0])

    for rep in range(2):
        for kind in KINDS:
            if rep == 1:
                mark()
            x = x0
            for i, L in enumerate(layers):
                kc, vc = caches[i]
                x, kc, vc = layer_fn(kind, L, x, kc, vc, off, pos)
                caches[i] = (kc, vc)
            mx.eval(x, caches)
    mark()


def ncu_report(path: str, layers_n: int = 2) -> None:
    import csv
    rows = list(csv.reader(l for l in open(path) if l.startswith('"')))
    head = rows[0]
    ki, vi, ui = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
    seq = []
    for r in rows[1:]:
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r[ui], 1.0)
        seq.append((r[ki], float(r[vi].replace(",", "")) * scale))
    marks = [i for i, (n, _) in enumerate(seq) if "probe_marker" in n]
    print(f"\n== ncu {os.path.basename(path)}: GPU time per kernel, one step of {layers_n} layers ==")
    for kind, (a, b) in zip(KINDS, zip(marks, marks[1:])):
        part = seq[a + 1 : b]
        total = sum(t for _, t in part)
        print(f"-- {kind}: {len(part)} kernels, {total:.1f} us total, {total / layers_n:.1f} us/layer")
        agg: dict[str, list[float]] = {}
        for n, t in part:
            agg.setdefault(n[:90], []).append(t)
        for n, ts in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
            print(f"   {sum(ts):8.1f} us {len(ts):4d}x  {n}")


def bandwidth() -> float:
    a = mx.random.normal((256 * 1024 * 1024,))
    mx.eval(a)
    t = timed(lambda: mx.eval(a + 1), 5)
    return 2 * a.nbytes / t / 1e9


if __name__ == "__main__":
    if sys.argv[1:2] == ["ncu-child"]:
        ncu_child(sys.argv[2])
        sys.exit(0)
    if sys.argv[1:2] == ["ncu-report"]:
        ncu_report(sys.argv[2])
        sys.exit(0)
    if sys.argv[1:] == ["dispatch-child"]:
        print(json.dumps(dispatch()))
        sys.exit(0)
    parts = sys.argv[1:] or ["dispatch", "kernels", "step"]
    print("mlx", mx.__version__, mx.default_device(), "copy bandwidth GB/s", round(bandwidth()))
    if "dispatch" in parts:
        dispatch_sweep()
    if "kernels" in parts:
        kernels_part()
    if "step" in parts:
        step_part()
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
