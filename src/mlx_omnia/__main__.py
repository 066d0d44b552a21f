"""`python -m mlx_omnia "PROMPT"`: stream one chat answer from a model (default: the embedded
SmolLM2-135M-Instruct)."""

from __future__ import annotations

import argparse
import sys

from mlx_omnia.allocator import reexec_with_jemalloc


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # started as a program: with jemalloc when installed (mlx_omnia.allocator)
        reexec_with_jemalloc()
    parser = argparse.ArgumentParser(
        prog="python -m mlx_omnia", description="Stream one chat answer from a local model."
    )
    parser.add_argument("prompt", nargs="?", help="the user message (read from stdin if omitted)")
    parser.add_argument("-m", "--model", default=None, help="checkpoint dir, .gguf, hub repo id")
    parser.add_argument("-s", "--system", default=None, help="a system message")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        parser.error("give a prompt as an argument or on stdin")

    from mlx_omnia.engine import Chat, ChatMessage, GenerationOptions, OmniaError, load

    messages: list[ChatMessage] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": prompt})
    try:
        model = load(args.model)
        options = GenerationOptions(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        for piece in model.stream(Chat(tuple(messages)), options):
            sys.stdout.write(piece.text)
            sys.stdout.flush()
    except OmniaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
