"""Small formatting helpers for human-readable output."""

from __future__ import annotations


def size(n: int | float | None) -> str:
    """Bytes in decimal units (1 MB = 1,000,000 bytes), as the web app and the Hugging Face hub
    write them: a whole number from 100 up, else one decimal."""
    if n is None:
        return "-"
    value = float(n)
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    while value >= 1000 and i < len(units) - 1:
        value /= 1000
        i += 1
    if i == 0 or value >= 100:
        return f"{int(value + 0.5)} {units[i]}"  # half up, as the web app's Math.round
    return f"{value:.1f} {units[i]}"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {s}s"
    return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
