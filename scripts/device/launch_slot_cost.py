"""Host time of a compiled chain of trivial custom kernels against their inputs and outputs
(H200 probe for issue 5): which part of a launch's host cost grows with what.

    python3 scripts/device/launch_slot_cost.py

Each variant compiles a function of LAUNCHES chained launches (each reads x and writes y[0] =
x[0] + 1, plus extra inputs it does not read and extra outputs it writes one value of), then
times the compiled call (build) and `mx.async_eval` (dispatch), medians over STEPS, with the
previous step waited on (host time only, the GPU idle at the start)."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

LAUNCHES, STEPS = 48, 200


def variant(n_in: int, n_out: int, big: bool) -> tuple[float, float]:
    names_in = ["x", *(f"i{j}" for j in range(n_in - 1))]
    names_out = ["y", *(f"o{j}" for j in range(n_out - 1))]
    body = "if (threadIdx.x == 0) {\n  y[0] = x[0] + 1.f;\n" + "".join(
        f"  o{j}[0] = 0.f;\n" for j in range(n_out - 1)) + "}\n"
    kernel = mx.fast.cuda_kernel(name=f"slots_{n_in}_{n_out}", input_names=names_in,
                                 output_names=names_out, source=body)
    size = 25_000_000 if big else 64  # 100 MB of float32 per extra input when big
    extras = [mx.zeros((size,), dtype=mx.float32) for _ in range(n_in - 1)]
    mx.eval(extras)

    def chain(x: mx.array) -> mx.array:
        for _ in range(LAUNCHES):
            outs = kernel(inputs=[x, *extras], output_shapes=[(64,)] * n_out,
                          output_dtypes=[mx.float32] * n_out, grid=(32, 1, 1),
                          threadgroup=(32, 1, 1))
            x = outs[0]
        return x

    step = mx.compile(chain)
    x = mx.zeros((64,), dtype=mx.float32)
    for _ in range(5):
        mx.eval(step(x))
    build: list[float] = []
    dispatch: list[float] = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        y = step(x)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        build.append(t1 - t0)
        dispatch.append(t2 - t1)
    return statistics.median(build) / LAUNCHES, statistics.median(dispatch) / LAUNCHES


def main() -> None:
    print(f"host us per launch ({LAUNCHES} launches compiled into one function; build = the "
          f"compiled call, dispatch = mx.async_eval)")
    for n_in, n_out, big in [(1, 1, False), (20, 1, False), (1, 7, False), (20, 7, False),
                             (40, 1, False), (1, 14, False), (6, 1, True), (12, 2, True)]:
        b, d = variant(n_in, n_out, big)
        print(f"  inputs {n_in:3d} outputs {n_out:3d}{' (100 MB inputs)' if big else '':16s} "
              f"build {b * 1e6:6.2f}  dispatch {d * 1e6:6.2f}  total {(b + d) * 1e6:6.2f}", flush=True)


if __name__ == "__main__":
    main()
