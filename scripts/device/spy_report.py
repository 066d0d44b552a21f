"""Summarize a py-spy raw profile (`py-spy record --native -f raw`): the share of samples in each
frame, inclusive and self, over the stacks that contain a marker frame (by default the probe's
`time_feed`, so loading and tracing are left out).

    python3 scripts/device/spy_report.py PROFILE[.gz] [MARKER [TOP]]
"""

from __future__ import annotations

import collections
import gzip
import re
import sys


def main() -> None:
    path = sys.argv[1]
    marker = sys.argv[2] if len(sys.argv) > 2 else "time_feed"
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            if marker not in stack:
                continue
            n = int(count)
            total += n
            frames = [re.sub(r"^0x[0-9a-f]+", "?", re.sub(r" \(.*?\)$", "", f))
                      for f in stack.split(";")]
            for frame in set(frames):
                inclusive[frame] += n
            own[frames[-1]] += n
    print(f"samples {total} (stacks with {marker})")
    for title, counts in (("inclusive", inclusive), ("self", own)):
        print(f"--- {title}")
        for frame, n in counts.most_common(top):
            print(f"{100 * n / max(total, 1):6.1f}% {frame[:160]}")


if __name__ == "__main__":
    main()
