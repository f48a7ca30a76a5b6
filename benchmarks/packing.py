"""Sequence packing vs padding: tokens/s on a batch of very uneven lengths, per backend.

    python -m benchmarks.packing [--size small] [--layouts fsdp1-dp2 dtensor-dp2 jax-fsdp2]
                                 [--batch 16] [--seq 256] [--budget 512] [--iters 3] [--json F]

For every layout two Policies run side by side in one process, on the same random model
(``benchmarks.compare.SIZES``) and the same batch: one pads every row to the batch width,
the other packs the sequences into rows of at most ``--budget`` tokens
(``policy.sequence_packing``).  Their calls alternate (padded, packed, padded, ...), so both
see the same background load, and the ratio packed / padded is taken from medians of the
same run.  The batch has a quarter of its rows at full width and the rest short, so most
of a padded batch is padding: the speed-up the padded-token fraction predicts is
``1 / (1 - padded fraction)`` for the token-proportional work (projections, MLP); packed
attention runs over whole packed rows with a block-diagonal mask, so it can cost more.
Tokens/s counts real tokens only.  The logprobs of both are compared as a check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.lib.packing import DEFAULT_LAYOUTS, report, run_packing
from benchmarks.lib.sizes import SIZES


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.packing", description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--budget", type=int, default=None, help="tokens per packed row (default 2 x --seq)")
    p.add_argument("--algorithm", default="modified_first_fit_decreasing")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="float32")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.budget = args.budget or 2 * args.seq
    args.micro, args.device = None, "cpu"
    args.ray_cpus = 2 * args.threads + 2  # two Policies (padded, packed) alive at once
    if args.budget < args.seq:
        p.error(f"--budget {args.budget} is smaller than --seq {args.seq}: a full-width row fits no packed row")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    results, failed = run_packing(args)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
