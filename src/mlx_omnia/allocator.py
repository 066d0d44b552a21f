"""jemalloc for the programs mlx-omnia starts (`omnia-server`, `python -m mlx_omnia`), on Linux.

A decode step's host time is mostly MLX building and dispatching its graph, and much of that is
small allocations: with jemalloc preloaded, omnia's host time per qwen3-4b 4-bit token on the
H200 fell ~20 % (3.6-3.8 -> 2.9-3.0 ms, 2026-12-03) and SmolLM2's decode on a 2-core CPU rose
~10 %. A running process cannot change its allocator, so `reexec_with_jemalloc` starts the
program again, once, with the library in LD_PRELOAD (same pid, same arguments). It does nothing
when the library is not installed (Debian/Ubuntu: `apt-get install libjemalloc2`), outside
Linux, or with OMNIA_JEMALLOC=0; OMNIA_JEMALLOC=/path/to/libjemalloc.so.2 picks a file.
Importing this module imports nothing heavy (no MLX)."""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV = "OMNIA_JEMALLOC"
_REEXECUTED = "OMNIA_JEMALLOC_REEXECUTED"  # set for the second start: never loop


def library() -> str | None:
    """The jemalloc to preload: OMNIA_JEMALLOC's file, else the system's, else None."""
    choice = os.environ.get(ENV, "")
    if choice == "0" or not sys.platform.startswith("linux"):
        return None
    if choice and choice != "1":
        return choice if Path(choice).is_file() else None
    return ctypes.util.find_library("jemalloc")


def loaded() -> str | None:
    """The path of the jemalloc mapped into this process, if one is (Linux), else None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and Path(fields[5]).name.startswith("libjemalloc"):
            return fields[5]
    return None


def note() -> str | None:
    """Said when jemalloc is installed but this process runs without it (it was installed after
    the start, or the start could not preload it): only a restart loads it."""
    if loaded() is not None or library() is None:
        return None
    return ("jemalloc is installed but this process started without it (~10-20 % more host "
            "time a token); restart it")


def reexec_with_jemalloc() -> None:
    """Start this program again with jemalloc preloaded, when it is installed and not loaded
    yet; returns (doing nothing) otherwise, or when the new start fails."""
    if os.environ.get(_REEXECUTED) or loaded() is not None:
        return
    lib = library()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_REEXECUTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return
