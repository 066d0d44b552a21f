"""Compile every CUDA kernel source the engine would build, with NVRTC, on a machine without a GPU.

The kernels' Python side runs for real (specs, launchers, input lists) on MLX's CPU backend, with
`mx.fast.cuda_kernel` replaced by a recorder that wraps each source the way a `__global__` entry
would take it (inputs `const T*`, outputs `T*`, `<input>_shape` arrays) and compiles it for sm_90.
Register counts and spills come back from ptxas (`--ptxas-options=-v`).

    pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux2014_x86_64 nvidia-cuda-nvrtc nvidia-cuda-runtime -d /tmp/nvrtc
    (cd /tmp/nvrtc && for f in *.whl; do unzip -qo $f -d x; done)
    python scripts/nvrtc_check.py /tmp/nvrtc/x/nvidia/cu13 [NAME_FILTER]

NVRTC_CUBIN_DIR=DIR also writes each cubin there, for `cuobjdump -sass` (the
nvidia-cuda-cuobjdump wheel) to show the machine code.

Without NVRTC: `--digest` prints the number of kernels and one SHA-256 over every kernel's
name, input and output names, body, header text and launch geometry (tests/test_kernel_sources.py
pins it); `--dump DIR` writes each kernel to DIR/NAME.cu, to diff two trees' kernels."""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx_omnia.engine  # noqa: F401  # first: it loads the system BLAS before MLX

# isort: split
import mlx.core as mx

C_TYPES = {
    mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float",
    mx.int32: "int", mx.uint32: "unsigned int", mx.uint8: "unsigned char", mx.int64: "long long",
}


class Nvrtc:
    def __init__(self, root: Path) -> None:
        self.lib = ctypes.CDLL(str(root / "lib" / "libnvrtc.so.13"))
        self.include = root / "include"

    def compile(self, name: str, source: str, cubin: Path | None = None) -> tuple[bool, str]:
        prog = ctypes.c_void_p()
        rc = self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                         0, None, None)
        assert rc == 0, rc
        opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-default-device",
                b"--ptxas-options=-v", f"-I{self.include}".encode()]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = self.lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, log)
        if cubin is not None and rc == 0:
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            binary = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetCUBIN(prog, binary)
            cubin.write_bytes(binary.raw)
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == 0, log.value.decode(errors="replace")


@dataclass
class Kernel:
    """One `mx.fast.cuda_kernel` the engine would make, and the launches it would get."""

    name: str
    inputs: list[str]
    outputs: list[str]
    body: str
    header: str        # the header's text (the engine passes an #include of a cached file)
    options: str       # the other keyword arguments
    launches: set[str] = field(default_factory=set[str])
    threads: int = 0   # of the last launch, and its argument types (for NVRTC)
    dtypes: list[str] = field(default_factory=list[str])

    def made(self) -> list[Any]:
        """What the kernel is made from."""
        return [self.name, self.inputs, self.outputs, self.body, self.header, self.options]

    def record(self) -> str:
        """Everything MLX builds and launches the kernel from, as one line of JSON."""
        return json.dumps([*self.made(), sorted(self.launches)])

    def entry(self) -> str:
        """The source as a `__global__` entry would take it (inputs `const T*`, outputs `T*`,
        `<input>_shape` arrays), for NVRTC."""
        params = [f"const {t}* {n}" for n, t in zip(self.inputs, self.dtypes, strict=False)]
        params += [f"const int* {n}_shape" for n in self.inputs if f"{n}_shape" in self.body]
        params += [f"{t}* {n}" for n, t in zip(self.outputs, self.dtypes[len(self.inputs):], strict=True)]
        return (f"{self.header}\nextern \"C\" __global__ void __launch_bounds__({self.threads}) "
                f"{self.name}({', '.join(params)}) {{\n{self.body}}}\n")


KERNELS: dict[str, Kernel] = {}
INCLUDE = re.compile(r'#include "([^"]+)"\n')


def header_text(header: str) -> str:
    """The text of a header the engine passes as an #include of its cached file."""
    included = INCLUDE.fullmatch(header)
    return Path(included.group(1)).read_text(encoding="utf-8") if included else header


def recorder(*, name: str, input_names: list[str], output_names: list[str], source: str,
             header: str = "", **options: Any) -> Any:
    kernel = Kernel(name, list(input_names), list(output_names), source, header_text(header),
                    repr(sorted(options.items())))
    known = KERNELS.setdefault(name, kernel)
    assert known.made() == kernel.made(), f"two kernels named {name}"

    def call(*, inputs: list[mx.array], output_shapes: list[Any], output_dtypes: list[mx.Dtype],
             grid: Any, threadgroup: Any, **more: Any) -> list[mx.array]:
        known.launches.add(repr((tuple(grid), tuple(threadgroup), [str(a.dtype) for a in inputs],
                                 [tuple(s) for s in output_shapes],
                                 [str(d) for d in output_dtypes], sorted(more.items()))))
        known.threads = threadgroup[0]
        known.dtypes = [C_TYPES[a.dtype] for a in inputs] + [C_TYPES[d] for d in output_dtypes]
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    return call


def digest() -> str:
    """SHA-256 over every kernel's record, in name order."""
    sha = hashlib.sha256()
    for name in sorted(KERNELS):
        sha.update(KERNELS[name].record().encode() + b"\n")
    return sha.hexdigest()


def build_all() -> None:
    from dataclasses import replace

    from mlx_omnia.engine.core.kernels.attention_step.cuda import AttentionStepSpec
    from mlx_omnia.engine.core.kernels.attention_step.cuda import launcher as attention_launcher
    from mlx_omnia.engine.core.kernels.attention_step.cuda import spec_fits as attention_fits
    from mlx_omnia.engine.core.kernels.qmv.cuda import CANDIDATES, QmvSpec, launcher, spec_fits

    def weights(spec: QmvSpec, n: int) -> list[mx.array]:
        if spec.bits is None:
            return [mx.zeros((n, spec.k), dtype=spec.dtype)]
        return [mx.zeros((n, spec.k * spec.bits // 32), dtype=mx.uint32),
                mx.zeros((n, spec.k // spec.group_size), dtype=spec.dtype),  # type: ignore[operator]
                mx.zeros((n, spec.k // spec.group_size), dtype=spec.dtype)]  # type: ignore[operator]

    def run_chained(project: QmvSpec, then: QmvSpec) -> None:
        from mlx_omnia.engine.core.kernels.qmv.cuda import chained_fits, chained_launcher

        if not chained_fits(project, then):
            return
        inputs = [mx.zeros((1, 1, project.k), dtype=project.dtype),
                  *weights(project, project.rows[0]),
                  mx.zeros((1, 1, project.rows[0]), dtype=project.dtype)]
        for n in then.rows:
            inputs += weights(then, n)
        inputs += [mx.zeros((then.k,), dtype=then.dtype), mx.zeros((3,), dtype=mx.int32)]
        chained_launcher(project, then, (1, 1))(inputs)

    def run_qmv(spec: QmvSpec) -> None:
        if not spec_fits(spec):
            return
        inputs = [mx.zeros((1, 1, spec.k), dtype=spec.dtype)]
        for n in spec.rows:
            inputs += weights(spec, n)
        if spec.norm_eps is not None:
            inputs.append(mx.zeros((spec.k,), dtype=spec.dtype))
        if spec.residual:
            inputs.append(mx.zeros((1, 1, spec.rows[0]), dtype=spec.dtype))
        launcher(spec, (1, 1))(inputs)

    for dtype in (mx.bfloat16, mx.float16):
        for bits, group in ((None, None), (4, 32), (4, 64), (4, 128), (8, 64)):
            base = QmvSpec(dtype=dtype, k=2560, rows=(4096, 1024, 1024), bits=bits,
                           group_size=group, norm_eps=1e-6)
            run_qmv(base)
            run_qmv(replace(base, rows=(9728, 9728), gate="silu"))
            run_qmv(replace(base, rows=(9728, 9728), gate="gelu_tanh"))
            run_qmv(replace(base, k=9728, rows=(2560,), norm_eps=None, residual=True))
            run_qmv(replace(base, rows=(151936,)))
            run_qmv(replace(base, k=576, rows=(49152,)))
            for k_in, d, inner in ((4096, 2560, 9728), (2048, 2048, 6144)):
                for gate in ("silu", "gelu_tanh"):
                    run_chained(replace(base, k=k_in, rows=(d,), norm_eps=None, residual=True),
                                replace(base, k=d, rows=(inner, inner), gate=gate))
            for launch in CANDIDATES:
                run_qmv(replace(base, rows=(9728, 9728), gate="silu", launch=launch))
                run_qmv(replace(base, k=9728, rows=(2560,), norm_eps=None, residual=True,
                                launch=launch))
    for dtype in (mx.bfloat16, mx.float16):
        for h, kv, d, qk in ((32, 8, 128, True), (32, 8, 64, False), (8, 8, 128, False),
                             (16, 2, 64, True), (8, 4, 32, True), (9, 3, 64, False)):
            for cap, hs in itertools.product((256, 2304, 8192, 49152), (1, 2)):
                spec = AttentionStepSpec(dtype=dtype, n_heads=h, n_kv_heads=kv, head_dim=d,
                                         capacity=cap, scale=d**-0.5, q_eps=1e-6 if qk else None,
                                         k_eps=1e-6 if qk else None, head_split=hs)
                if not attention_fits(spec):
                    continue
                inputs = [mx.zeros((1, 1, h * d), dtype=dtype), mx.zeros((1, 1, kv * d), dtype=dtype),
                          mx.zeros((1, 1, kv * d), dtype=dtype)]
                if qk:
                    inputs += [mx.zeros((d,), dtype=dtype), mx.zeros((d,), dtype=dtype)]
                inputs += [mx.zeros((d // 2,), dtype=mx.float32),
                           mx.zeros((1, kv, cap, d), dtype=dtype), mx.zeros((1, kv, cap, d), dtype=dtype),
                           mx.zeros((), dtype=mx.int32), mx.zeros((kv,), dtype=mx.int32)]
                attention_launcher(spec, (1, 1))(inputs)
    from mlx_omnia.engine.core.kernels.attention_step.cuda import CodesSpec, codes_fits, codes_launcher

    for dtype in (mx.bfloat16, mx.float16):
        for (h, kv, d), (bits, group) in itertools.product(
            ((32, 8, 128), (32, 4, 128), (16, 2, 64), (8, 8, 64)), ((8, 64), (4, 64), (8, 32), (4, 32), (8, 128))
        ):
            for cap, hs in itertools.product((256, 2304, 49152), (1, 2)):
                codes = CodesSpec(dtype=dtype, n_heads=h, n_kv_heads=kv, head_dim=d, capacity=cap,
                                  scale=d**-0.5, bits=bits, group_size=group, head_split=hs)
                if not codes_fits(codes):
                    continue
                words, groups = d * bits // 32, d // group
                parts = [mx.zeros((1, kv, cap, words), dtype=mx.uint32),
                         mx.zeros((1, kv, cap, groups), dtype=dtype),
                         mx.zeros((1, kv, cap, groups), dtype=dtype)]
                codes_launcher(codes)(
                    [mx.zeros((1, h, 1, d), dtype=dtype), *parts, *parts,
                     mx.zeros((4,), dtype=mx.int32), mx.zeros((kv * 2,), dtype=mx.int32)],
                    mx.zeros((4,), dtype=mx.float32))
    build_moe()
    build_project_route()
    build_route_experts()
    build_project_attend()
    build_rows()


def build_moe() -> None:
    from mlx_omnia.engine.core.kernels.moe.cuda import (
        ExpertsSpec,
        RouteSpec,
        experts_fits,
        experts_launcher,
        route_fits,
        route_launcher,
    )

    for dtype in (mx.bfloat16, mx.float16):
        for e, k, first, norm in ((128, 8, False, True), (64, 8, False, False), (8, 2, True, False),
                                  (60, 4, False, False), (512, 32, False, True)):
            spec = RouteSpec(dtype, e, k, first, norm)
            if route_fits(spec):
                route_launcher(spec)(mx.zeros((e,), dtype=dtype))
        from mlx_omnia.engine.core.kernels.moe.cuda import routed_fits, routed_launcher
        from mlx_omnia.engine.core.kernels.qmv.cuda import QmvSpec

        for e, k, (bits, group) in ((128, 8, (4, 64)), (128, 8, (None, None)), (60, 4, (4, 64)),
                                    (128, 8, (8, 64)), (64, 8, (4, 64))):
            route = RouteSpec(dtype, e, k, False, True)
            router = QmvSpec(dtype=dtype, k=2048, rows=(e,), bits=bits, group_size=group,
                             norm_eps=1e-6)
            if routed_fits(route, router):
                w = ([mx.zeros((e, 2048), dtype=dtype)] if bits is None else
                     [mx.zeros((e, 2048 * bits // 32), dtype=mx.uint32),
                      mx.zeros((e, 2048 // group), dtype=dtype),  # type: ignore[operator]
                      mx.zeros((e, 2048 // group), dtype=dtype)])  # type: ignore[operator]
                routed_launcher(route, router)([mx.zeros((2048,), dtype=dtype), *w,
                                                mx.zeros((2048,), dtype=dtype)])
        for bits, group in ((None, None), (4, 32), (4, 64), (8, 64)):
            # qwen3-30b-a3b, olmoe, qwen2_moe-ish, a tiny test shape
            for hidden, inner, top in ((2048, 768, 8), (2048, 1024, 8), (2048, 1408, 4), (256, 64, 2)):
                up = ExpertsSpec(dtype, hidden, inner, top, bits, group, gate_up=True)
                up_norm = ExpertsSpec(dtype, hidden, inner, top, bits, group, gate_up=True,
                                      norm_eps=1e-6)
                for spec in (up, up_norm, ExpertsSpec(dtype, inner, hidden, top, bits, group, gate_up=False),
                             ExpertsSpec(dtype, inner, hidden, top, bits, group, gate_up=False,
                                         residual=True)):
                    if not experts_fits(spec):
                        continue
                    def mats(n: int, kk: int, bits: int | None = bits, group: int | None = group,
                             dtype: mx.Dtype = dtype) -> list[mx.array]:
                        if bits is None:
                            return [mx.zeros((16, n, kk), dtype=dtype)]
                        return [mx.zeros((16, n, kk * bits // 32), dtype=mx.uint32),
                                mx.zeros((16, n, kk // group), dtype=dtype),  # type: ignore[operator]
                                mx.zeros((16, n, kk // group), dtype=dtype)]  # type: ignore[operator]
                    ids = mx.zeros((spec.top_k,), dtype=mx.uint32)
                    if spec.gate_up:
                        inputs = [mx.zeros((spec.k,), dtype=dtype), ids, *mats(2 * spec.rows, spec.k)]
                        if spec.norm_eps is not None:
                            inputs.append(mx.zeros((spec.k,), dtype=dtype))
                    else:
                        inputs = [mx.zeros((spec.top_k, spec.k), dtype=dtype), ids,
                                  mx.zeros((spec.top_k,), dtype=dtype), *mats(spec.rows, spec.k)]
                        if spec.residual:
                            inputs.append(mx.zeros((spec.rows,), dtype=dtype))
                    experts_launcher(spec)(inputs)
                chain(up_norm, ExpertsSpec(dtype, inner, hidden, top, bits, group, gate_up=False,
                                           residual=True), mats)
                chain(up, ExpertsSpec(dtype, inner, hidden, top, bits, group, gate_up=False), mats)


def mats(n: int, k: int, bits: int | None, group: int | None, dtype: mx.Dtype) -> list[mx.array]:
    """Zero weights of an n x k matrix, dense or affine-quantized (weight, scales, biases)."""
    if bits is None:
        return [mx.zeros((n, k), dtype=dtype)]
    return [mx.zeros((n, k * bits // 32), dtype=mx.uint32),
            mx.zeros((n, k // group), dtype=dtype),  # type: ignore[operator]
            mx.zeros((n, k // group), dtype=dtype)]  # type: ignore[operator]


def build_project_route() -> None:
    """o_proj + residual, then the router and routing of the sum, in one launch (qwen3_moe)."""
    from mlx_omnia.engine.core.kernels.moe.cuda import (
        RouteSpec,
        project_route_fits,
        project_route_launcher,
    )
    from mlx_omnia.engine.core.kernels.qmv.cuda import QmvSpec

    for dtype in (mx.bfloat16, mx.float16):
        for bits, group in ((None, None), (4, 64), (8, 64), (4, 32)):
            # qwen3-30b-a3b (4096 -> 2048, 128 experts top 8), olmoe-ish, a tiny test shape
            for k_in, hidden, e, top in ((4096, 2048, 128, 8), (2048, 2048, 64, 8),
                                         (256, 256, 8, 2), (512, 256, 60, 4)):
                project = QmvSpec(dtype=dtype, k=k_in, rows=(hidden,), bits=bits,
                                  group_size=group, residual=True)
                router = QmvSpec(dtype=dtype, k=hidden, rows=(e,), bits=bits, group_size=group,
                                 norm_eps=1e-6)
                route = RouteSpec(dtype, e, top, False, True)
                if not project_route_fits(project, route, router):
                    continue
                inputs = [mx.zeros((k_in,), dtype=dtype), *mats(hidden, k_in, bits, group, dtype),
                          mx.zeros((hidden,), dtype=dtype), *mats(e, hidden, bits, group, dtype),
                          mx.zeros((hidden,), dtype=dtype), mx.zeros((4,), dtype=mx.int32)]
                project_route_launcher(project, route, router)(inputs)


def build_route_experts() -> None:
    """o_proj + residual -> router -> routing -> expert gate/up -> down, one launch (qwen3_moe's
    RouteExperts)."""
    from mlx_omnia.engine.core.kernels.moe.cuda import (
        ExpertsSpec,
        RouteSpec,
        route_experts_fits,
        route_experts_launcher,
        route_experts_project,
    )
    from mlx_omnia.engine.core.kernels.qmv.cuda import QmvSpec

    for dtype in (mx.bfloat16, mx.float16):
        for bits, group in ((None, None), (4, 64), (8, 64), (4, 32)):
            # qwen3-30b-a3b (4096 -> 2048, 128 experts of 768, top 8), a small test shape
            for k_in, hidden, e, inner, top in ((4096, 2048, 128, 768, 8), (256, 256, 8, 64, 2),
                                                (512, 256, 60, 128, 4)):
                project = route_experts_project(QmvSpec(
                    dtype=dtype, k=k_in, rows=(hidden,), bits=bits, group_size=group,
                    residual=True))
                router = QmvSpec(dtype=dtype, k=hidden, rows=(e,), bits=bits, group_size=group,
                                 norm_eps=1e-6)
                route = RouteSpec(dtype, e, top, False, True)
                up = ExpertsSpec(dtype, hidden, inner, top, bits, group, gate_up=True,
                                 norm_eps=1e-6)
                down = ExpertsSpec(dtype, inner, hidden, top, bits, group, gate_up=False,
                                   residual=True)
                if not route_experts_fits(project, route, router, up, down):
                    continue

                def emats(n: int, k: int) -> list[mx.array]:
                    return [m[None] for m in mats(n, k, bits, group, dtype)]

                inputs = [mx.zeros((k_in,), dtype=dtype), *mats(hidden, k_in, bits, group, dtype),
                          mx.zeros((hidden,), dtype=dtype), *mats(e, hidden, bits, group, dtype),
                          mx.zeros((hidden,), dtype=dtype), *emats(2 * inner, hidden),
                          *emats(hidden, inner), mx.zeros((6,), dtype=mx.int32)]
                for local in (False, True):
                    route_experts_launcher(project, route, router, up, down,
                                           local_route=local)(inputs)


def build_project_attend() -> None:
    """The q/k/v projections, then the attention of them, in one launch (qwen3, qwen3_moe)."""
    from mlx_omnia.engine.core.kernels.attention_step.cuda import (
        AttentionStepSpec,
        project_attend_fits,
        project_attend_launcher,
    )
    from mlx_omnia.engine.core.kernels.qmv.cuda import QmvSpec

    for dtype in (mx.bfloat16, mx.float16):
        for bits, group in ((None, None), (4, 64), (8, 64), (4, 32)):
            # qwen3-4b, qwen3-30b-a3b, a small test shape
            for k, h, kv, d in ((2560, 32, 8, 128), (2048, 32, 4, 128), (256, 4, 2, 64)):
                for cap, hs in itertools.product((256, 2304, 49152), (1, 2)):
                    qkv = QmvSpec(dtype=dtype, k=k, rows=(h * d, kv * d, kv * d), bits=bits,
                                  group_size=group, norm_eps=1e-6)
                    spec = AttentionStepSpec(dtype=dtype, n_heads=h, n_kv_heads=kv, head_dim=d,
                                             capacity=cap, scale=d**-0.5, q_eps=1e-6, k_eps=1e-6,
                                             head_split=hs)
                    if not project_attend_fits(qkv, spec):
                        print(f"declined: project_attend {qkv.name()} {spec.tag()}")
                        continue
                    inputs = [mx.zeros((1, 1, k), dtype=dtype)]
                    for n in qkv.rows:
                        inputs += mats(n, k, bits, group, dtype)
                    inputs += [mx.zeros((k,), dtype=dtype), mx.zeros((d,), dtype=dtype),
                               mx.zeros((d,), dtype=dtype), mx.zeros((d // 2,), dtype=mx.float32),
                               mx.zeros((1, kv, cap, d), dtype=dtype),
                               mx.zeros((1, kv, cap, d), dtype=dtype), mx.zeros((), dtype=mx.int32),
                               mx.zeros((kv,), dtype=mx.int32), mx.zeros((3,), dtype=mx.int32)]
                    project_attend_launcher(qkv, spec, (1, 1))(inputs)


def build_rows() -> None:
    """A batch's rows (2-16 tokens): the tensor-core qmv, the attention, the routing and the
    experts of every row in one launch each."""
    from dataclasses import replace

    from mlx_omnia.engine.core.kernels.attention_step.cuda import (
        AttentionStepSpec,
        rows_launcher,
    )
    from mlx_omnia.engine.core.kernels.attention_step.cuda import spec_fits as attention_fits
    from mlx_omnia.engine.core.kernels.moe.cuda import (
        ExpertsSpec,
        RouteSpec,
        experts_fits,
        experts_rows_launcher,
        route_rows_launcher,
    )
    from mlx_omnia.engine.core.kernels.qmv.cuda import QmvSpec, rows_fits
    from mlx_omnia.engine.core.kernels.qmv.cuda import rows_launcher as qmv_rows

    rows = 8
    for dtype in (mx.bfloat16, mx.float16):
        for group in (64, 128):
            base = QmvSpec(dtype=dtype, k=2560, rows=(4096, 1024, 1024), bits=4, group_size=group)
            for spec in (base, replace(base, rows=(9728, 9728), gate="silu"),
                         replace(base, rows=(9728, 9728), gate="gelu_tanh"),
                         replace(base, k=9728, rows=(2560,), residual=True),
                         replace(base, k=4096, rows=(2560,), residual=True),
                         replace(base, rows=(151936,)), replace(base, k=2048, rows=(128,)),
                         replace(base, k=1024, rows=(768, 768))):
                if not rows_fits(spec):
                    print(f"declined: rows {spec.name()}")
                    continue
                inputs = [mx.zeros((rows, 1, spec.k), dtype=dtype)]
                for n in spec.rows:
                    inputs += mats(n, spec.k, 4, group, dtype)
                if spec.residual:
                    inputs.append(mx.zeros((rows, 1, spec.rows[0]), dtype=dtype))
                qmv_rows(spec, (rows, 1))(inputs)
        for h, kv, d, qk in ((32, 8, 128, True), (32, 8, 64, False), (16, 2, 64, True)):
            for cap, hs in itertools.product((256, 2304, 49152), (1, 2)):
                att = AttentionStepSpec(dtype=dtype, n_heads=h, n_kv_heads=kv, head_dim=d,
                                        capacity=cap, scale=d**-0.5, q_eps=1e-6 if qk else None,
                                        k_eps=1e-6 if qk else None, head_split=hs)
                if not attention_fits(att):
                    continue
                inputs = [mx.zeros((rows, 1, h * d), dtype=dtype),
                          mx.zeros((rows, 1, kv * d), dtype=dtype),
                          mx.zeros((rows, 1, kv * d), dtype=dtype)]
                if qk:
                    inputs += [mx.zeros((d,), dtype=dtype), mx.zeros((d,), dtype=dtype)]
                inputs += [mx.zeros((d // 2,), dtype=mx.float32),
                           mx.zeros((rows, kv, cap, d), dtype=dtype),
                           mx.zeros((rows, kv, cap, d), dtype=dtype),
                           mx.zeros((rows,), dtype=mx.int32), mx.zeros((64 * kv * 2,), dtype=mx.int32)]
                rows_launcher(att, rows)(inputs)
        route = RouteSpec(dtype, 128, 8, False, True)
        route_rows_launcher(route, rows, (rows, 1))(mx.zeros((rows, 1, 128), dtype=dtype))
        for bits, group in ((None, None), (4, 64)):
            for norm in (None, 1e-6):
                up = ExpertsSpec(dtype, 2048, 768, 8, bits, group, gate_up=True, norm_eps=norm)
                if experts_fits(up):
                    inputs = [mx.zeros((rows, 1, 2048), dtype=dtype),
                              mx.zeros((rows, 1, 8), dtype=mx.uint32),
                              *(m[None] for m in mats(2 * 768, 2048, bits, group, dtype))]
                    if norm is not None:
                        inputs.append(mx.zeros((2048,), dtype=dtype))
                    experts_rows_launcher(up, rows, (rows, 1))(inputs)
            for residual in (False, True):
                down = ExpertsSpec(dtype, 768, 2048, 8, bits, group, gate_up=False,
                                   residual=residual)
                if experts_fits(down):
                    inputs = [mx.zeros((rows, 1, 8, 768), dtype=dtype),
                              mx.zeros((rows, 1, 8), dtype=mx.uint32),
                              mx.zeros((rows, 1, 8), dtype=dtype),
                              *(m[None] for m in mats(2048, 768, bits, group, dtype))]
                    if residual:
                        inputs.append(mx.zeros((rows, 1, 2048), dtype=dtype))
                    experts_rows_launcher(down, rows, (rows, 1))(inputs)


def chain(up: Any, down: Any, mats: Any) -> None:
    """chain_launcher: expert gate/up then down in one launch (the kernel qwen3_moe's experts bind)."""
    from mlx_omnia.engine.core.kernels.moe.cuda import chain_fits, chain_launcher

    if not chain_fits(up, down):
        return
    inputs = [mx.zeros((up.k,), dtype=up.dtype), mx.zeros((up.top_k,), dtype=mx.uint32),
              mx.zeros((up.top_k,), dtype=up.dtype), *mats(2 * up.rows, up.k),
              *mats(down.rows, down.k)]
    if up.norm_eps is not None:
        inputs.append(mx.zeros((up.k,), dtype=up.dtype))
    if down.residual:
        inputs.append(mx.zeros((down.rows,), dtype=up.dtype))
    inputs.append(mx.zeros((3,), dtype=mx.int32))
    chain_launcher(up, down)(inputs)


def build_recorded() -> None:
    """Every kernel the engine would build, into KERNELS (headers cached in a fresh directory)."""
    os.environ["OMNIA_KERNEL_HEADERS"] = tempfile.mkdtemp(prefix="omnia-nvrtc-check-")
    mx.fast.cuda_kernel = recorder  # type: ignore[assignment]
    build_all()


def main() -> int:
    if sys.argv[1:2] == ["--digest"]:
        build_recorded()
        print(f"{len(KERNELS)} kernels sha256 {digest()}")
        return 0
    if sys.argv[1:2] == ["--dump"]:
        build_recorded()
        out = Path(sys.argv[2])
        out.mkdir(parents=True, exist_ok=True)
        for name, kernel in KERNELS.items():
            (out / f"{name}.cu").write_text(kernel.entry() + "// launches\n" + "".join(
                f"// {launch}\n" for launch in sorted(kernel.launches)), encoding="utf-8")
        print(f"{len(KERNELS)} kernels written to {out}")
        return 0
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/nvrtc/x/nvidia/cu13")
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    build_recorded()
    nvrtc = Nvrtc(root)
    failed = 0
    for name, kernel in sorted(KERNELS.items()):
        if only not in name:
            continue
        sass = os.environ.get("NVRTC_CUBIN_DIR")
        ok, log = nvrtc.compile(name, kernel.entry(),
                                Path(sass) / f"{name}.cubin" if sass else None)
        regs = re.findall(r"Used (\d+) registers", log)
        spill = re.findall(r"(\d+) bytes spill stores", log)
        smem = re.findall(r"(\d+) bytes smem", log)
        print(f"{'ok  ' if ok else 'FAIL'} regs={','.join(regs) or '?':>4} spill={','.join(spill) or '0'} "
              f"smem={','.join(smem) or '?'} {name}")
        if not ok:
            failed += 1
            print(log[:4000])
    print(f"{len(KERNELS)} kernels, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
