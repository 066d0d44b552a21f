"""Reading back the two tensor layouts mlx-lm's sanitize writes (and `mlx_lm.utils.save` keeps)
that differ from the hub's, for the families whose sanitize meets them: a depthwise Conv1d
weight stored channels-last, and a zero-centred RMS norm weight (scaled by 1 + weight) stored
as 1 + weight. Each family's checkpoint.py says which of its tensors these are."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


def is_channels_last(weight: mx.array, kernel_size: int) -> bool:
    """A depthwise Conv1d weight as MLX's Conv1d holds it, [channels, K, 1], not as torch does,
    [channels, 1, K]. With K == 1 the two are one shape (and one tensor): never channels-last."""
    return kernel_size > 1 and tuple(weight.shape[1:]) == (kernel_size, 1)


def torch_convs(
    weights: dict[str, mx.array], is_conv: Callable[[str], bool], kernel_size: int
) -> tuple[dict[str, mx.array], bool]:
    """`weights` with every depthwise Conv1d weight (named so by `is_conv`) as torch stores it,
    [channels, 1, K], and whether any was stored channels-last."""
    out: dict[str, mx.array] = {}
    moved = False
    for name, tensor in weights.items():
        if is_conv(name) and is_channels_last(tensor, kernel_size):
            tensor, moved = tensor.swapaxes(1, 2), True
        out[name] = tensor
    return out, moved


def zero_centred(one_plus: mx.array) -> mx.array:
    """A (1 + weight) RMS norm's `weight` from the stored 1 + weight: the difference in float32,
    exact for float16 and for bfloat16 of magnitude 2^-16 to 2^16, so the norm's float32
    1 + weight is the stored value bit for bit (a float32 checkpoint's within its rounding)."""
    return one_plus.astype(mx.float32) - 1.0
