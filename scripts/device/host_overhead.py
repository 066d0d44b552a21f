"""Where a decode step's time goes outside the kernels (H200 probe for issue 5).

For one model shape, in one process:
  wait      a decode step, evaluated and waited on (what omnia-bench times)
  host      the host time of one step: building and dispatching it, returning before the GPU ends
            (mx.async_eval), with the GPU idle at the start
  pipelined steps queued one ahead (as Model.generate and mlx-lm's generate run them)
  generate  Model.generate's own decode rate over the same number of tokens
for the arms in OVERHEAD_ARMS (omnia, omnia-reference, mlx-lm; default omnia,mlx-lm),
and, for scale, a chain of N trivial custom kernels compiled into one function (time per op,
waited and host-only).

    python3 scripts/device/host_overhead.py [SHAPE [QUANT_BITS [LAYERS]]]    # e.g. qwen3-4b 4
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx_omnia

_ENGINE_FIRST = mlx_omnia.runtime_info
import mlx.core as mx  # noqa: E402

from mlx_omnia import GenerationOptions  # noqa: E402
from mlx_omnia.bench import measure, shapes  # noqa: E402


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def time_feed(feed: measure.Feed, steps: int) -> tuple[float, float, float, float]:
    """(waited, host-only, pipelined, build) seconds per decode step of one sequence; build is
    the part of host-only spent building the step's graph (Python, compiled-function replay),
    before mx.async_eval hands it to MLX's evaluator."""
    mx.eval(*feed(list(range(1, 1 + int(os.environ.get("OVERHEAD_PROMPT", "128"))))))
    for t in range(4):
        mx.eval(*feed([3 + t]))
    wait: list[float] = []
    host: list[float] = []
    build: list[float] = []
    for t in range(steps):
        start = time.perf_counter()
        out, state = feed([5 + t % 100])
        del state  # held, a cache slice would turn an in-place cache update into a copy
        built = time.perf_counter()
        mx.async_eval(out)
        queued = time.perf_counter()
        mx.eval(out)
        done = time.perf_counter()
        build.append(built - start)
        host.append(queued - start)
        wait.append(done - start)
    start = time.perf_counter()
    pending, state = feed([7])
    del state
    mx.async_eval(pending)
    for t in range(steps):
        following, state = feed([9 + t % 100])
        del state
        mx.async_eval(following)
        mx.eval(pending)
        pending = following
    mx.eval(pending)
    pipelined = (time.perf_counter() - start) / (steps + 1)
    return statistics.median(wait), statistics.median(host), pipelined, statistics.median(build)


def report(label: str, timing: tuple[float, float, float, float]) -> None:
    wait, host, pipelined, build = timing
    print(f"   {label:<8} wait {wait * 1e6:8.1f} us ({1 / wait:6.1f} tok/s)  host {host * 1e6:8.1f} us"
          f" (build {build * 1e6:7.1f})  pipelined {pipelined * 1e6:8.1f} us ({1 / pipelined:6.1f} tok/s)",
          flush=True)


def checkpoint(name: str, tmp: Path, bits: int | None) -> tuple[Path, tuple[int, int] | None]:
    """The random checkpoint of shape `name` (kept in OVERHEAD_CKPT across processes, else in
    tmp) and the quantization to apply at load. OVERHEAD_PREQUANTIZE=1 writes it quantized (a
    MoE shape's bf16 weights would not fit the disk), and the arms load it as it is."""
    keep = os.environ.get("OVERHEAD_CKPT")
    target = Path(keep) if keep else tmp / "m"
    written = bits is not None and bool(os.environ.get("OVERHEAD_PREQUANTIZE"))
    if (target / "config.json").exists():
        path = target
    else:
        path = shapes.build_checkpoint(name, target, dtype="bfloat16",
                                       quantize=(bits, 64) if written and bits else None)
    return path, None if bits is None or written else (bits, 64)


def load_arm(arm_name: str, path: Path, quant: tuple[int, int] | None) -> measure.Arm | None:
    """omnia, omnia-eager, omnia-reference or mlx-lm (None when mlx-lm is not importable)."""
    if arm_name == "mlx-lm":
        if measure.mlx_lm_importable() is None:
            return None
        return measure.mlx_lm_arm(str(path), dtype="bfloat16", quantize=quant)
    return measure.omnia_arm(str(path), dtype="bfloat16", quantize=quant,
                             reference=arm_name == "omnia-reference",
                             eager=arm_name == "omnia-eager")


def probe_model(shape: str, bits: int | None, layers: int | None, steps: int) -> None:
    name = shape
    if layers is not None:
        name = f"{shape}-{layers}"
        shapes.SHAPES[name] = dict(shapes.SHAPES[shape], num_hidden_layers=layers)
    arms = os.environ.get("OVERHEAD_ARMS", "omnia,mlx-lm").split(",")
    ops_note = f"{bits}-bit" if bits else "bf16"
    print(f"== {name} {ops_note} MLX_MAX_OPS_PER_BUFFER={os.environ.get('MLX_MAX_OPS_PER_BUFFER', '-')}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path, quant = checkpoint(name, Path(tmp), bits)
        for arm_name in arms:
            arm = load_arm(arm_name, path, quant)
            if arm is None:
                continue
            report(arm_name, time_feed(arm.new_sequence(), steps))
            if arm_name == "omnia" and not os.environ.get("OVERHEAD_NO_GENERATE"):
                # Model.generate's own loop: `steps` more tokens, prefill cancelled by the
                # difference of two runs.
                model = mlx_omnia.load(str(path), dtype="bfloat16",
                                       quantize=None if quant is None else {"bits": bits, "group_size": 64})
                prompt = "hello " * 64
                times: list[float] = []
                for n in (1, steps + 1, 1, steps + 1):
                    start = time.perf_counter()
                    model.generate(prompt, GenerationOptions(max_tokens=n, temperature=0.0))
                    times.append(time.perf_counter() - start)
                rate = steps / ((times[3] - times[2] + times[1] - times[0]) / 2)
                print(f"   generate {rate:8.1f} tok/s", flush=True)
                del model
            del arm
            mx.clear_cache()


def probe_chain(n: int, reps: int = 50, extra: int = 0) -> None:
    """A compiled chain of n trivial kernels, each taking `extra` more (unused) inputs."""
    names = ["x"] + [f"e{i}" for i in range(extra)]
    kernel = mx.fast.cuda_kernel(
        name=f"probe_add_one_{extra}", input_names=names, output_names=["y"],
        source="const int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) y[i] = x[i] + 1.f;",
    ) if mx.cuda.is_available() else None
    extras = [mx.zeros((64,)) + i for i in range(extra)]
    mx.eval(extras)

    def chain(x: mx.array) -> mx.array:
        for _ in range(n):
            if kernel is None:
                x = x + 1.0
            else:
                x = kernel(inputs=[x, *extras], output_shapes=[x.shape], output_dtypes=[x.dtype],
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
    kind = f"custom kernels ({1 + extra} inputs)" if kernel is not None else "adds (no CUDA)"
    print(f"== compiled chain of {n} {kind}: waited {median_us(wait) / n:6.2f} us/op, "
          f"host {median_us(host) / n:6.2f} us/op")


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b"
    bits = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "0" else None
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else None
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    print(mx.default_device(), flush=True)
    if not os.environ.get("OVERHEAD_SKIP_CHAIN"):
        for n in (16, 256):
            probe_chain(n)
        probe_chain(256, extra=7)
    if os.environ.get("OVERHEAD_ARMS") != "none":
        probe_model(shape, bits, layers, steps)


if __name__ == "__main__":
    main()
