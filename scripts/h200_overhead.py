"""Where a decode step's time goes outside the kernels (H200 probe for issue 5).

For one model shape, in one process:
  wait      a compiled decode step, evaluated and waited on (what omnia-bench times)
  host      the host time of one step: building and dispatching it, returning before the GPU ends
            (mx.async_eval), with the GPU idle at the start
  pipelined steps queued one ahead (as Model.generate runs them): time per token
  generate  Model.generate's own decode rate over the same number of tokens
and, for scale, a chain of N trivial custom kernels compiled into one function (time per op,
waited and host-only).

    python3 scripts/h200_overhead.py [SHAPE [QUANT_BITS [LAYERS]]]    # e.g. qwen3-4b 4
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx_omnia

_ENGINE_FIRST = mlx_omnia.runtime_info
import mlx.core as mx  # noqa: E402

from mlx_omnia import GenerationOptions  # noqa: E402
from mlx_omnia.bench import shapes  # noqa: E402


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def probe_model(shape: str, bits: int | None, layers: int | None, steps: int) -> None:
    name = shape
    if layers is not None:
        name = f"{shape}-{layers}"
        shapes.SHAPES[name] = dict(shapes.SHAPES[shape], num_hidden_layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = shapes.build_checkpoint(name, Path(tmp) / "m", dtype="bfloat16")
        quantize = None if bits is None else {"bits": bits, "group_size": 64}
        model = mlx_omnia.load(str(path), dtype="bfloat16", quantize=quantize)
        kinds = sorted(set(model.bindings().values()))
        seq = model.decoding()
        mx.eval(seq.feed(list(range(1, 129))), seq.state())
        for t in range(4):
            mx.eval(seq.feed([3 + t]), seq.state())

        wait: list[float] = []
        host: list[float] = []
        for t in range(steps):
            start = time.perf_counter()
            out = seq.feed([5 + t % 100])
            mx.async_eval(out, seq.state())
            queued = time.perf_counter()
            mx.eval(out)
            done = time.perf_counter()
            host.append(queued - start)
            wait.append(done - start)

        start = time.perf_counter()
        pending = seq.feed([7])
        mx.async_eval(pending, seq.state())
        for t in range(steps):
            following = seq.feed([9 + t % 100])
            mx.async_eval(following, seq.state())
            mx.eval(pending)
            pending = following
        mx.eval(pending)
        pipelined = (time.perf_counter() - start) / (steps + 1)

        # Generation's own loop (queued one step ahead): `steps` more tokens, prefill cancelled
        # by the difference of two runs (random text need not decode into pieces as it goes).
        prompt = "hello " * 64
        times = []
        for n in (1, steps + 1, 1, steps + 1):
            start = time.perf_counter()
            model.generate(prompt, GenerationOptions(max_tokens=n, temperature=0.0))
            times.append(time.perf_counter() - start)
        rate = steps / ((times[3] - times[2] + times[1] - times[0]) / 2)

    ops_note = f"{bits}-bit" if bits else "bf16"
    print(f"== {name} {ops_note} bindings {kinds}")
    print(f"   wait (bench)   {median_us(wait):8.1f} us/token  ({1e6 / median_us(wait):6.1f} tok/s)")
    print(f"   host only      {median_us(host):8.1f} us/token")
    print(f"   pipelined      {pipelined * 1e6:8.1f} us/token  ({1 / pipelined:6.1f} tok/s)")
    print(f"   generate       {rate:8.1f} tok/s")


def probe_chain(n: int, reps: int = 50) -> None:
    kernel = mx.fast.cuda_kernel(
        name="probe_add_one", input_names=["x"], output_names=["y"],
        source="const int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) y[i] = x[i] + 1.f;",
    ) if mx.cuda.is_available() else None

    def chain(x: mx.array) -> mx.array:
        for _ in range(n):
            if kernel is None:
                x = x + 1.0
            else:
                x = kernel(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype],
                           grid=(x.shape[0], 1, 1), threadgroup=(256, 1, 1))[0]
        return x

    f = mx.compile(chain)
    x = mx.zeros((4096,))
    for _ in range(5):
        mx.eval(f(x))
    wait, host = [], []
    for _ in range(reps):
        start = time.perf_counter()
        y = f(x)
        mx.async_eval(y)
        queued = time.perf_counter()
        mx.eval(y)
        wait.append(time.perf_counter() - start)
        host.append(queued - start)
    kind = "custom kernels" if kernel is not None else "adds (no CUDA)"
    print(f"== compiled chain of {n} {kind}: waited {median_us(wait) / n:6.2f} us/op, "
          f"host {median_us(host) / n:6.2f} us/op")


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b"
    bits = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "0" else None
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else None
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    print(mx.default_device(), flush=True)
    for n in (16, 256):
        probe_chain(n)
    probe_model(shape, bits, layers, steps)


if __name__ == "__main__":
    main()
