"""`omnia-server`: serve the engine over HTTP."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_omnia.allocator import reexec_with_jemalloc

if TYPE_CHECKING:
    from mlx_omnia.server.settings import Settings


def parse_size(text: str) -> int:
    """A byte count: a number, optionally with K/M/G/T (decimal: 12G or 12GB is 12,000,000,000
    bytes, as sizes are shown) or Ki/Mi/Gi/Ti (binary: 12GiB)."""
    t = text.strip().lower().removesuffix("b")
    binary = t.endswith("i")
    t = t.removesuffix("i")
    powers = {"k": 1, "m": 2, "g": 3, "t": 4}
    if t and t[-1] in powers:
        return int(float(t[:-1]) * (1024 if binary else 1000) ** powers[t[-1]])
    if binary:
        raise ValueError(f"not a size: {text!r}")
    return int(t)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # started as a program: with jemalloc when installed (mlx_omnia.allocator)
        reexec_with_jemalloc()
    settings = build_settings(argv)
    host, port = settings.host, settings.port

    import uvicorn

    from mlx_omnia.server.app import create_app

    app = create_app(settings)
    from mlx_omnia import runtime_notes

    for note in runtime_notes():  # what the machine could make faster, said at start
        print(f"WARNING: {note}", file=sys.stderr, flush=True)
    manager = app.state.omnia.manager
    if settings.model:
        path = Path(settings.model).expanduser()
        model_id = manager.add_alias(path) if path.exists() else manager.check_id(settings.model)
        manager.default_id = model_id
        manager.release(manager.get(model_id))
    uvicorn.run(app, host=host, port=port, log_level="info")
    return 0


def build_settings(argv: list[str] | None) -> Settings:
    """The server's settings from its command line (None: sys.argv)."""
    from mlx_omnia.server.settings import Settings

    parser = argparse.ArgumentParser(prog="omnia-server", description="Serve models over HTTP.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8642)
    parser.add_argument("--model", default=None, help="preload: a hub repo id, a directory or .gguf")
    parser.add_argument("--api-key", default=os.environ.get("OMNIA_API_KEY"))
    parser.add_argument("--memory-limit", type=parse_size, default=None, help="e.g. 12G")
    parser.add_argument("--idle-ttl", type=float, default=30 * 60.0, help="seconds")
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--max-concurrent", type=int, default=8,
                        help="generations of one model decoded together (continuous batching)")
    parser.add_argument("--prefix-cache-memory", type=parse_size, default=None,
                        help="memory for cached prompt prefixes, e.g. 2G (0: off)")
    parser.add_argument("--prefix-cache-disk", type=parse_size, default=None,
                        help="disk for cached prompt prefixes, e.g. 8G (0: off)")
    parser.add_argument("--prefix-cache-dir", default=None,
                        help="where the disk tier lives (default: the platform's cache dir)")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                        help="cache keys and values as 8- or 4-bit codes (default: as computed)")
    parser.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                        help="a quantized cache's group of head dims sharing a scale")
    parser.add_argument("--request-kv-bits", action="store_true",
                        help="let a request ask for its own KV cache format (its kv_bits field)")
    parser.add_argument("--cors-origin", action="append", default=[])
    parser.add_argument("--max-body", type=parse_size, default=None, help="request body limit, e.g. 8M")
    args = parser.parse_args(argv)

    settings = Settings(host=args.host, port=args.port, api_key=args.api_key, idle_ttl=args.idle_ttl,
                        max_queue=args.max_queue, max_concurrent=args.max_concurrent, cors_origins=tuple(args.cors_origin), model=args.model)
    if args.memory_limit is not None:
        settings.memory_limit = args.memory_limit
    if args.prefix_cache_memory is not None:
        settings.prefix_memory = args.prefix_cache_memory
    if args.prefix_cache_disk is not None:
        settings.prefix_disk = args.prefix_cache_disk
    if args.prefix_cache_dir is not None:
        settings.prefix_dir = Path(args.prefix_cache_dir)
    settings.kv_bits, settings.kv_group_size = args.kv_bits, args.kv_group_size
    settings.request_kv_bits = args.request_kv_bits
    if args.max_body is not None:
        settings.max_body_bytes = args.max_body
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        print(f"WARNING: serving on {args.host} without an API key: anyone who can reach this "
              "address can use the models. Set --api-key or OMNIA_API_KEY.", file=sys.stderr)
    return settings


if __name__ == "__main__":
    raise SystemExit(main())
