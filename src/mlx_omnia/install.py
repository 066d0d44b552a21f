"""Which install of mlx-omnia a process runs: a stamp of the installed distribution (its
version, its RECORD of files and how it was installed), taken when a server starts and again by
the CLI, so `omnia status` can tell a server started before a reinstall (`pip install` over it,
editable or not) from a current one. Standard library only: the CLI imports it."""

from __future__ import annotations

import hashlib
from importlib import metadata

DISTRIBUTION = "mlx-omnia"


def install_stamp() -> str:
    """A short digest of the installed distribution's version, file record and install origin;
    "unknown" when the package runs without being installed (a bare source tree)."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"
    parts = (dist.version, dist.read_text("RECORD") or "", dist.read_text("direct_url.json") or "")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def installed_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"
