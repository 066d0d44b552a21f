"""What every omnia-bench command shares: the environment, the checkpoint, the token stream, the
free generation's prompt and sampling, the bandwidth line and writing the report."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

import mlx_omnia
from mlx_omnia.bench import bandwidth, measure, results_file
from mlx_omnia.bench.shapes import SHAPES, build_checkpoint, shape_config

Out = Callable[[str], None]

def progress(message: str) -> None:
    print(f"[omnia-bench] {message}", file=sys.stderr, flush=True)


def git_revision(tree: Path) -> str | None:
    """`git describe` of the tree; OMNIA_BENCH_REVISION overrides it (a copied tree whose git
    metadata is stale, as on a lent machine)."""
    if os.environ.get("OMNIA_BENCH_REVISION"):
        return os.environ["OMNIA_BENCH_REVISION"]
    try:
        rev = subprocess.run(
            ["git", "-C", str(tree), "describe", "--always", "--dirty"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev or None


def source_root() -> Path:
    """The tree this mlx_omnia was imported from (…/src/mlx_omnia/__init__.py -> …)."""
    return Path(mlx_omnia.__file__).resolve().parents[2]


def environment() -> dict[str, Any]:
    """Device and versions, as printed and as written to the JSON."""
    info: dict[str, Any] = dict(mlx_omnia.runtime_info())
    info["device"] = str(mx.default_device())
    info["mlx"] = str(getattr(mx, "__version__", "?"))
    info["mlx_lm"] = measure.mlx_lm_importable()
    info["mlx_omnia_revision"] = git_revision(source_root())
    info["source_sha256"] = results_file.source_digest(
        results_file.tree_files(Path(mlx_omnia.__file__).resolve().parent)
    )
    info["python"] = platform.python_version()
    info["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    info["device_info"] = bandwidth.device_info()
    info["device_name"] = info["device_info"].get("device_name")
    return info


def print_environment(env: dict[str, Any], out: Out) -> None:
    out(
        f"device: {env['device']} ({env.get('backend')})  mlx {env['mlx']}  "
        f"mlx-lm {env['mlx_lm'] or 'not importable'}  "
        f"mlx-omnia {env.get('mlx_omnia_revision') or env.get('mlx_omnia') or '?'}  "
        f"python {env['python']}  blas {env.get('blas') or 'MLX default'}"
    )


@contextmanager
def checkpoint(
    model: str, *, dtype: str, seed: int, workdir: str | None,
    quantize: tuple[int, int] | None = None, layers: int | None = None,
) -> Generator[Path, None, None]:
    """A checkpoint directory: `model` itself when it is one, else a random-weight checkpoint
    of the named shape (its first `layers` layers when given), built for this run and removed
    after it (written already quantized when `quantize` is given)."""
    given = Path(model)
    if given.is_dir():
        if layers is not None:
            raise SystemExit("--layers cuts a named shape as it is built; a checkpoint directory "
                             "is loaded whole: leave out --layers, or name a shape")
        yield given
        return
    if model not in SHAPES:
        raise SystemExit(
            f"--model {model!r} is neither a checkpoint directory nor a known shape "
            f"({', '.join(SHAPES)})"
        )
    shape_config(model, layers)  # a --layers out of range stops here, before any building
    with tempfile.TemporaryDirectory(prefix="omnia-bench-", dir=workdir) as tmp:
        q = "" if quantize is None else f", written {quantize[0]}-bit g{quantize[1]}"
        cut = "" if layers is None else f", its first {layers} layers"
        progress(f"building a random-weight {model} checkpoint ({dtype}{q}{cut}) in {tmp}")
        yield build_checkpoint(model, Path(tmp) / model, dtype=dtype, seed=seed,
                               quantize=quantize, layers=layers)


def add_layers_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="with a named shape: build its first N layers only (the layer pattern "
                        "cut to match), so a model too large for both arms in one process runs "
                        "its real layer dimensions; the results name the cut")


def layers_json(model: str, layers: int | None) -> dict[str, int] | None:
    """The cut as the results record it: the first N layers of the shape's M, or None (whole)."""
    if layers is None:
        return None
    return {"first": layers, "of": int(SHAPES[model]["num_hidden_layers"])}


def model_source(model: str, path: Path, layers: int | None) -> str:
    """What ran, as the output's model line and the results' `model.source` say it."""
    if Path(model).is_dir():
        return str(path)
    cut = layers_json(model, layers)
    return f"random {model}" + ("" if cut is None else f" (first {cut['first']} of {cut['of']} layers)")


def token_stream(path: Path, *, prompt: int, generate: int, seed: int) -> tuple[list[int], list[int]]:
    """Fixed random ids below the model's vocab_size: the prompt, then the teacher-forced ids."""
    config = cast(dict[str, Any], json.loads((path / "config.json").read_text()))
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(0, vocab, size=prompt + generate)]
    return ids[:prompt], ids[prompt:]


def quantize_of(args: argparse.Namespace) -> tuple[int, int] | None:
    return None if args.quantize is None else (int(args.quantize), int(args.group_size))


def written_quantized(args: argparse.Namespace) -> tuple[int, int] | None:
    """--prequantize: the quantization build_checkpoint writes (the arms then load it as is)."""
    if not getattr(args, "prequantize", False):
        return None
    if args.quantize is None or Path(args.model).is_dir():
        raise SystemExit("--prequantize needs --quantize BITS and a named shape as --model")
    return quantize_of(args)


def at_load(args: argparse.Namespace) -> tuple[int, int] | None:
    """The quantization the arms apply at load: none when the checkpoint was written quantized."""
    return None if written_quantized(args) else quantize_of(args)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


DECODE_NOTE = ("decode = steps queued one ahead, as a generation loop runs them (the rate a "
               "generation sustains); step = one step evaluated and waited on (its latency)")


GENERATE_NOTE = ("generate = a free generation of {n} tokens through each engine's own API "
                 "(omnia Model.stream, mlx-lm stream_generate): temperature {temperature}, "
                 "top_p {top_p}, top_k {top_k}, seed {seed}, stop string {stop!r}; its decode "
                 "rate counts the tokens after the first text over the time after it")


def sampling_of(args: argparse.Namespace) -> measure.Sampling:
    return measure.Sampling(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def prompt_text(path: Path, ids: Sequence[int]) -> str:
    """The free generation's prompt: the prompt ids decoded by the checkpoint's tokenizer (the
    bench's vocabulary encodes it back to the same ids)."""
    tokenizers: Any = importlib.import_module("tokenizers")
    return cast(str, tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).decode(list(ids)))


WORD = re.compile(r" [a-z]+")


def vocabulary_words(path: Path) -> list[str]:
    """The checkpoint's tokens that decode to a space and lowercase letters: text of them encodes
    back to one token a word (the bench's vocabulary does so by construction)."""
    tokenizers: Any = importlib.import_module("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    size = int(tokenizer.get_vocab_size())
    words = [w for w in (cast(str, tokenizer.decode([i])) for i in range(size))
             if WORD.fullmatch(w)]
    if len(words) < 26:
        raise SystemExit(f"{path}'s vocabulary has {len(words)} word tokens (a space and a-z); "
                         "a few dozen are needed")
    return words


def random_words(words: Sequence[str], n: int, rng: np.random.Generator) -> str:
    """`n` words drawn from `words` (each with its leading space: n tokens in the bench's
    vocabulary)."""
    return "".join(words[int(i)] for i in rng.integers(0, len(words), n))


def print_bandwidth(bw: bandwidth.Bandwidth, step_bytes: int, out: Out) -> None:
    methods = ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in bw.methods.items())
    spec = "no datasheet figure" if bw.spec is None else f"datasheet {bw.spec / 1e9:,.0f} GB/s"
    out(f"memory bandwidth: best {bw.best / 1e9:,.1f} GB/s ({methods} GB/s); {bw.card or 'no GPU'}, "
        f"{spec}. floor tok/s = best / the {step_bytes / 1e6:,.1f} MB a decode step reads")
    for name, error in bw.errors.items():
        out(f"copy method {name} failed: {error}")


def write_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if getattr(args, "results", None):
        saved = results_file.save(report, Path(args.results))
        progress(f"results written to {saved}")


def quantize_json(
    at_load: tuple[int, int] | None, on_disk: tuple[int, int] | None
) -> dict[str, Any] | None:
    if on_disk is not None:
        return {"bits": on_disk[0], "group_size": on_disk[1], "on_disk": True}
    return None if at_load is None else {"bits": at_load[0], "group_size": at_load[1]}


def quantize_text(at_load: tuple[int, int] | None, on_disk: tuple[int, int] | None) -> str:
    """The weights' quantization as the output's model line says it."""
    if on_disk is not None:
        return f"affine {on_disk[0]}-bit g{on_disk[1]} (written quantized)"
    return "none" if at_load is None else f"affine {at_load[0]}-bit g{at_load[1]}"


def report_head(
    command: str, env: dict[str, Any], source: str, model: str, config: Any
) -> dict[str, Any]:
    """The first keys every bench report has: the command, the environment, the card and the
    model (a named shape, or None for a checkpoint directory)."""
    return {
        "command": command,
        "environment": env,
        "card": bandwidth.card_name() if env.get("backend") == "cuda" else None,
        "model": {"source": source, "shape": None if Path(model).is_dir() else model,
                  "config": config},
    }
