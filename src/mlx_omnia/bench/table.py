"""The printed table of an omnia-bench run: one row per arm, medians over runs, ratios to the
baseline measured in the same run, and each run's own ratio."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_omnia.bench import bandwidth, measure
from mlx_omnia.bench.common import median


@dataclass
class Row:
    arm: str
    prefill_tok_s: float
    decode_tok_s: float          # pipelined: steps queued one ahead, a generation loop's rate
    step_tok_s: float            # 1 / the median latency of one waited step
    weight_bytes: int
    floor_tok_s: float | None    # the step's bytes over the best copy bandwidth measured
    step_bytes: int = 0          # weights one decode step reads (the floor's numerator)
    spec_floor_tok_s: float | None = None  # the same over the card's datasheet bandwidth
    generate_tok_s: float | None = None    # free generation's decode rate (stream API)
    first_token_s: float | None = None     # free generation: the call to the first text
    prefill_ratio: float | None = None
    decode_ratio: float | None = None
    step_ratio: float | None = None
    generate_ratio: float | None = None

    @property
    def floor_share(self) -> float | None:
        return None if not self.floor_tok_s else self.decode_tok_s / self.floor_tok_s

    @property
    def spec_share(self) -> float | None:
        return None if not self.spec_floor_tok_s else self.decode_tok_s / self.spec_floor_tok_s


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or value != value else f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> str:
    return _fmt(None if value is None else 100 * value, ".1f", " %")


def table(rows: Sequence[Row], against: str) -> str:
    head = (
        "arm", "prefill tok/s", "decode tok/s", "generate tok/s", "first token ms",
        f"prefill vs {against}", f"decode vs {against}", f"generate vs {against}",
        "step tok/s", "weights MB", "floor tok/s", "% of floor", "% of spec",
    )
    body = [
        (
            r.arm,
            _fmt(r.prefill_tok_s, ",.1f"),
            _fmt(r.decode_tok_s, ",.2f"),
            _fmt(r.generate_tok_s, ",.2f"),
            _fmt(None if r.first_token_s is None else 1e3 * r.first_token_s, ",.1f"),
            _fmt(r.prefill_ratio, ".3f", "x"),
            _fmt(r.decode_ratio, ".3f", "x"),
            _fmt(r.generate_ratio, ".3f", "x"),
            _fmt(r.step_tok_s, ",.2f"),
            _fmt(r.weight_bytes / 1e6, ",.1f"),
            _fmt(r.floor_tok_s, ",.1f"),
            _pct(r.floor_share),
            _pct(r.spec_share),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])


def per_run_decode_ratios(
    results: dict[str, list[measure.RunResult]], baseline: str
) -> dict[str, list[float]]:
    """Each arm's pipelined decode rate over the baseline's, run by run (the arms of one run ran
    one after another): how far the medians' ratio moves between runs."""
    base = results.get(baseline)
    if not base:
        return {}
    return {
        name: [b.decode_pipelined_s / x.decode_pipelined_s for x, b in zip(runs, base, strict=True)]
        for name, runs in results.items()
        if name != baseline
    }


def per_run_generate_ratios(
    results: dict[str, list[measure.RunResult]], baseline: str
) -> dict[str, list[float]]:
    """The same for the free generation's decode rate."""
    rates = {
        name: [x.generation.decode_tok_s for x in runs if x.generation is not None]
        for name, runs in results.items()
    }
    base = rates.get(baseline)
    if not base or len(base) != len(results[baseline]):
        return {}
    return {
        name: [x / b for x, b in zip(values, base, strict=True)]
        for name, values in rates.items()
        if name != baseline and len(values) == len(base)
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def set_ratios(rows: list[Row], baseline: str) -> None:
    base = next((r for r in rows if r.arm == baseline), None)
    if base is None:
        return
    for r in rows:
        r.prefill_ratio = r.prefill_tok_s / base.prefill_tok_s
        r.decode_ratio = r.decode_tok_s / base.decode_tok_s
        r.step_ratio = r.step_tok_s / base.step_tok_s
        r.generate_ratio = _ratio(r.generate_tok_s, base.generate_tok_s)


def generation_medians(runs: Sequence[measure.RunResult]) -> tuple[float | None, float | None]:
    """(decode tok/s, seconds to the first token) of the free generations, medians."""
    done = [x.generation for x in runs if x.generation is not None]
    if not done:
        return None, None
    return median([g.decode_tok_s for g in done]), median([g.first_s for g in done])


def row_of(
    name: str, runs: Sequence[measure.RunResult], prompt: int, weight_bytes: int,
    read: int | None, bw: bandwidth.Bandwidth,
) -> Row:
    gen_rate, first = generation_medians(runs)
    return Row(
        arm=name,
        prefill_tok_s=prompt / median([x.prefill_s for x in runs]),
        decode_tok_s=1.0 / median([x.decode_pipelined_s for x in runs]),
        step_tok_s=1.0 / median([x.decode_median_s for x in runs]),
        weight_bytes=weight_bytes,
        floor_tok_s=bw.best / read if read else None,
        step_bytes=read or 0,
        spec_floor_tok_s=bw.spec / read if read and bw.spec else None,
        generate_tok_s=gen_rate,
        first_token_s=first,
    )


def run_json(x: measure.RunResult) -> dict[str, Any]:
    return {
        "prefill_s": x.prefill_s,
        "decode_median_s": x.decode_median_s,
        "decode_step_s": x.decode_step_s,
        "decode_pipelined_s": x.decode_pipelined_s,
        "generation": None if x.generation is None else x.generation.to_json(),
    }


def row_json(r: Row) -> dict[str, Any]:
    return {
        "arm": r.arm,
        "prefill_tok_s": r.prefill_tok_s,
        "decode_tok_s": r.decode_tok_s,
        "step_tok_s": r.step_tok_s,
        "generate_tok_s": r.generate_tok_s,
        "first_token_s": r.first_token_s,
        "step_ratio": r.step_ratio,
        "prefill_ratio": r.prefill_ratio,
        "decode_ratio": r.decode_ratio,
        "generate_ratio": r.generate_ratio,
        "weight_bytes": r.weight_bytes,
        "step_bytes": r.step_bytes,
        "floor_tok_s": r.floor_tok_s,
        "floor_share": r.floor_share,
        "spec_floor_tok_s": r.spec_floor_tok_s,
        "spec_share": r.spec_share,
    }
