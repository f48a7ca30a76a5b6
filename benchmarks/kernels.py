"""Chunked ``logprobs_from_logits`` vs naive ``log_softmax`` + gather, torch and jax.

    python -m benchmarks.kernels [--shape 8 1024 32000] [--repeats 3] [--engines torch jax]

Every (engine, implementation, pass) case runs in its own subprocess so that peak memory
is that case's alone: after the inputs exist and one warm-up call has run (jax compiles
there), the kernel's resident-set high-water mark is reset (``/proc/self/clear_refs``),
the timed calls run, and the peak is read back.  Reported: median seconds and peak extra
memory (above inputs) per case, and dualrl/naive ratios from the same run.
For jax the compiled program's own buffer plan (temp + output) is printed too.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.lib.kernels import report, spawn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=3, default=[8, 1024, 32000], metavar=("B", "S", "V"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    parser.add_argument("--no-backward", action="store_true", help="forward pass only")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    passes = [False] if args.no_backward else [False, True]
    results = [
        spawn(engine, impl, backward, args.shape, args.repeats)
        for engine in args.engines
        for backward in passes
        for impl in ("naive", "dualrl")
    ]
    print(report(results, args.shape))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
