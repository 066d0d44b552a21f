"""What the CUDA kernels' Python side shares: the activation dtypes' C types, and the one step
that makes kernel sources from the package's `.cuh` (device code) and `.cu` (launch bodies and
device calls) files: named `${NAME}` placeholders filled from keyword values, nothing else."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

import mlx.core as mx

STATIC_SMEM = 48 * 1024  # a block's static shared memory

# CUDA C type of each activation dtype the kernels take.
CUDA_TYPES: dict[mx.Dtype, str] = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half"}

# A placeholder alone on its line (group 1: it takes whole lines) or within a line (group 2).
PLACEHOLDER = re.compile(r"^\$\{(\w+)\}\n|\$\{(\w+)\}", re.MULTILINE)


def flag(value: bool) -> str:
    """A C++ bool literal."""
    return "true" if value else "false"


@cache
def cuda_file(path: str) -> str:
    """The text of a `.cu`/`.cuh` file of the kernels package (`path` relative to it)."""
    kernels = resources.files("mlx_omnia.engine.core.kernels")
    return kernels.joinpath(*path.split("/")).read_text(encoding="utf-8")


def render(path: str, **values: str | int) -> str:
    """cuda_file(path) with every `${NAME}` replaced by values[NAME], in one pass: alone on its
    line it takes whole lines (empty, or ending with a newline), within a line one line. A
    placeholder without a value, a value without a placeholder, or a stray `$` is an error."""
    text = cuda_file(path)
    named = {block or inline for block, inline in PLACEHOLDER.findall(text)}
    if named != values.keys() or "$" in PLACEHOLDER.sub("", text):
        raise ValueError(f"{path}: placeholders {sorted(named)}, values {sorted(values)}")

    def value(match: re.Match[str]) -> str:
        block, inline = match.groups()
        got = str(values[block or inline])
        if block and got and not got.endswith("\n"):
            raise ValueError(f"{path}: ${{{block}}} takes whole lines, got {got!r}")
        if inline and "\n" in got:
            raise ValueError(f"{path}: ${{{inline}}} takes one line, got {got!r}")
        return got

    return PLACEHOLDER.sub(value, text)


def trailing(args: list[str]) -> str:
    """Optional arguments after a call's fixed ones (or template arguments after the fixed ones),
    each after ", "; "" for none."""
    return "".join(", " + arg for arg in args)


def header(*parts: str) -> str:
    """A kernel header made of `.cuh` texts, each after an empty line (a header that extends
    another is that header + header(more))."""
    return "".join("\n" + part for part in parts)


HEADER = header(render("common.cuh"))
