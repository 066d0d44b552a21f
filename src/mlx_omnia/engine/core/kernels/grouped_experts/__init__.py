"""Grouped expert matmuls bound to GateUp and DownCombine on a GPU: the declarations' own core
calls with the (token, selected expert) rows grouped by expert (core/moe.py `ExpertGroups`)
where a call has many rows, a prefill chunk: each block of one expert's rows is one matrix
product (mx.gather_qmm / mx.gather_mm with the block's rows as M), so an expert's weights are
read once a block instead of once a row. The products are the declared ones, row for row; only
which rows share a launch changes. On a CPU the blocks' padding costs more than the weight reads
it saves, so the kernel applies where MLX's default device is a GPU (any: it launches nothing of
its own). Registered as general kernels, so the CUDA expert kernels (kernels/moe) are tried
first; they hand such calls to the same grouped core calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_omnia.engine.core.binding import Kernel, register
from mlx_omnia.engine.core.moe import DownCombine, GateUp


def gpu_backend() -> bool:
    """True when MLX's default device is a GPU (Metal or CUDA)."""
    return mx.default_device() == mx.gpu


class GroupedGateUp(Kernel[GateUp]):
    """GateUp's products grouped by expert over many rows (a row at a time otherwise)."""

    name = "grouped_experts"
    declaration = GateUp
    general = True

    def fits(self, decl: GateUp) -> bool:
        return True  # the declaration's own arithmetic, every format and option

    def applies(self, decl: GateUp) -> bool:
        return gpu_backend()

    def build(self, decl: GateUp) -> Callable[[mx.array, mx.array], mx.array]:
        return decl.reference(grouped=True)


class GroupedDownCombine(Kernel[DownCombine]):
    """DownCombine's products (and its declared gate/up's) grouped by expert over many rows."""

    name = "grouped_experts"
    declaration = DownCombine
    general = True

    def fits(self, decl: DownCombine) -> bool:
        return True

    def applies(self, decl: DownCombine) -> bool:
        return gpu_backend()

    def build(self, decl: DownCombine) -> Callable[..., Any]:
        return decl.reference(grouped=True)


register(GroupedGateUp())
register(GroupedDownCombine())
