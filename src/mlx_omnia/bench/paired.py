"""`omnia-bench paired`: this tree against another revision, each arm in its own process."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, cast

from mlx_omnia.bench import bandwidth, common, measure
from mlx_omnia.bench.table import Row, row_json, set_ratios, table


def _reference_tree(ref: str, into: Path) -> Path:
    """A tree with src/mlx_omnia: `ref` itself when it is such a directory, else the git
    revision `ref` of this checkout, extracted with `git archive` (no worktree, no checkout)."""
    given = Path(ref)
    if (given / "src" / "mlx_omnia").is_dir():
        return given.resolve()
    root = common.source_root()
    try:
        data = subprocess.run(
            ["git", "-C", str(root), "archive", "--format=tar", ref, "src"],
            capture_output=True, check=True, timeout=120,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise SystemExit(
            f"--ref {ref!r}: not a tree with src/mlx_omnia and not a revision git can archive in "
            f"{root} ({detail.decode(errors='replace').strip() or e}); on a machine without the "
            "git history, extract it first: git archive REV src | tar -x -C bench-ref"
        ) from e
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def _run_child(tree: Path, spec_file: Path, out_file: Path) -> dict[str, Any]:
    script = Path(measure.__file__).resolve()
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run(
        [sys.executable, "-P", str(script), str(spec_file), str(out_file)], env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"the bench arm under {tree} failed (exit {done.returncode})")
    result = cast(dict[str, Any], json.loads(out_file.read_text()))
    imported = Path(str(result["mlx_omnia_file"])).resolve()
    if not imported.is_relative_to(tree.resolve()):
        raise SystemExit(f"the arm for {tree} imported mlx_omnia from {imported}, not from that tree")
    return result


def paired(args: argparse.Namespace, out: common.Out = print) -> dict[str, Any]:
    """This tree against another revision, each arm in its own process (one process per run:
    a fresh process pays its own loads and warm-ups), runs alternated; medians and the ratio."""
    env = common.environment()
    quantize, on_disk = common.at_load(args), common.written_quantized(args)
    work_tree = common.source_root()
    with (
        common.checkpoint(
            args.model, dtype=args.dtype, seed=args.seed, workdir=args.workdir, quantize=on_disk,
            layers=args.layers,
        ) as path,
        tempfile.TemporaryDirectory(prefix="omnia-bench-paired-") as tmp,
    ):
        ref_tree = _reference_tree(args.ref, Path(tmp) / "ref")
        prompt, generate = common.token_stream(
            path, prompt=args.prompt, generate=args.generate, seed=args.seed
        )
        text = None if args.no_generation else common.prompt_text(path, prompt)
        sampling = common.sampling_of(args)
        spec = {
            "path": str(path), "dtype": args.dtype,
            "quantize": None if quantize is None else list(quantize),
            "reference": False, "prompt": prompt, "generate": generate, "runs": 1,
            "text": text, "sampling": None if text is None else sampling.to_json(),
        }
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        common.progress(f"memory bandwidth ({args.bandwidth_mib} MiB)")
        bw = bandwidth.measure(args.bandwidth_mib * 2**20, backend=env.get("backend"))
        trees = {"working": work_tree, f"ref {args.ref}": ref_tree}
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        names = list(trees)
        for r in range(args.runs):
            for name in names[r % 2:] + names[: r % 2]:
                common.progress(f"run {r + 1}/{args.runs}: {name} ({trees[name]})")
                child = _run_child(trees[name], spec_file, Path(tmp) / "out.json")
                results[name].append(child)

    rows: list[Row] = []
    for name in names:
        runs = [run for child in results[name] for run in child["runs"]]
        weight_bytes = int(results[name][0]["weight_bytes"])
        read = int(results[name][0].get("step_bytes", 0)) or weight_bytes
        gens = [measure.GenerationRun(**x["generation"]) for x in runs if x.get("generation")]
        rows.append(Row(
            arm=name,
            prefill_tok_s=len(prompt) / common.median([float(x["prefill_s"]) for x in runs]),
            decode_tok_s=1.0 / common.median([float(x.get("decode_pipelined_s", "nan")) for x in runs]),
            step_tok_s=1.0 / common.median([common.median(x["decode_step_s"]) for x in runs]),
            weight_bytes=weight_bytes,
            floor_tok_s=bw.best / read if read else None,
            step_bytes=read,
            spec_floor_tok_s=bw.spec / read if read and bw.spec else None,
            generate_tok_s=common.median([g.decode_tok_s for g in gens]) if gens else None,
            first_token_s=common.median([g.first_s for g in gens]) if gens else None,
        ))
    set_ratios(rows, names[1])
    first_runs = [results[name][0]["runs"][0] for name in names]
    same = first_runs[0]["decode_argmax"] == first_runs[1]["decode_argmax"]
    common.print_environment(env, out)
    source = common.model_source(args.model, path, args.layers)
    out(f"model: {source}  dtype {args.dtype}  prompt {len(prompt)}  generate {len(generate)}  "
        f"runs {args.runs}  working {common.git_revision(work_tree) or work_tree}  ref {args.ref}")
    common.print_bandwidth(bw, rows[0].step_bytes, out)
    out(f"check: decode argmax streams {'identical' if same else 'DIFFER'} between the trees")
    out(common.DECODE_NOTE)
    if text is not None:
        out(common.GENERATE_NOTE.format(**sampling.to_json(), n=len(generate)))
    out("")
    out(table(rows, "ref"))
    report: dict[str, Any] = {
        "command": "paired",
        "environment": env,
        "ref": args.ref,
        "model": {"source": source, "shape": None if Path(args.model).is_dir() else args.model},
        "options": {"dtype": args.dtype, "quantize": common.quantize_json(quantize, on_disk),
                    "layers": common.layers_json(args.model, args.layers),
                    "prompt": len(prompt), "generate": len(generate), "runs": args.runs,
                    "seed": args.seed, "like_for_like": True,
                    "sampling": None if text is None else sampling.to_json()},
        "bandwidth": bw.to_json(),
        "copy_bandwidth_bytes_per_s": bw.best,
        "argmax_identical": same,
        "arms": results,
        "table": [row_json(r) for r in rows],
    }
    common.write_report(report, args)
    return report
