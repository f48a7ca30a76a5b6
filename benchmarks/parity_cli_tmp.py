"""``dualrl parity`` / ``python -m benchmarks.parity``: the flags and :func:`main`."""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import torch_backends as tb
from benchmarks.layouts import GRAMMAR
from benchmarks.parity.report import format_matrix
from benchmarks.parity.run import run_parity
from benchmarks.parity.settings import DEFAULT_LAYOUTS, LEARNING_RATE


def package_doc() -> str:
    """The package docstring: the whole description of the run, as ``--help`` prints it."""
    import benchmarks.parity

    return benchmarks.parity.__doc__


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m benchmarks.parity",
        description=package_doc(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=DEFAULT_LAYOUTS,
        help=f"default: {' '.join(DEFAULT_LAYOUTS)}; any of {' '.join(tb.LAYOUTS)}, or by the grammar {GRAMMAR}",
    )
    parser.add_argument(
        "--model",
        default="llama",
        help="a core.testing tiny model (llama, qwen2, tiny-qwen2, ...), tiny-llama-hd32, "
        "tiny-gpt2 (built here), a local HF path or a hub id",
    )
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument(
        "--crossload", default="ring", choices=["ring", "full"], help="which layout loads which export (see above)"
    )
    parser.add_argument(
        "--engine",
        nargs="*",
        metavar="LAYOUT",
        help="the vLLM token_mult_prob_error check: on every layout (no names) or on these; "
        "needs a model vLLM's CPU attention serves (head_dim 32: --model tiny-llama-hd32)",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=24)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per layout (torch_backends' budget)")
    parser.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16: bf16 compute over fp32 master weights, judged by BF16_TOLERANCES",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    engine = False if args.engine is None else (args.engine or True)
    try:
        results = run_parity(
            args.layouts,
            args.model,
            batch=args.batch,
            seq=args.seq,
            threads=args.threads,
            crossload=args.crossload,
            lr=args.lr,
            engine=engine,
            precision=args.precision,
        )
    except (ValueError, OSError) as err:  # a bad argument, or a model that does not load
        print(f"parity: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(format_matrix(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if results["passed"] else 1
