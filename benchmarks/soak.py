"""Soak: many cycles of (one train step + one refit into vLLM); memory must stay flat, losses reproducible.

    python -m benchmarks.soak [--cycles 1000] [--backend torch_fsdp|torch_dtensor|jax_pjit]
                              [--transport ipc|collective] [--json F]

What runs, what is measured and when it passes: ``benchmarks.lib.soak``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.lib.ray_session import RaySession
from benchmarks.lib.soak import BACKENDS, JAX_DEVICES, format_report, soak
from core.reporting import show_logs_above_progress


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--backend", choices=BACKENDS, default="torch_fsdp")
    p.add_argument("--transport", choices=("ipc", "collective"), default="ipc")
    p.add_argument("--warmup", type=int, default=50, help="cycles before the reference memory sample")
    p.add_argument("--sample-every", type=int, default=50, help="memory sample period (cycles)")
    p.add_argument("--check-cycles", type=int, default=30, help="cycles the same-seed replay runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-kb", type=int, default=48, help="refit bucket size (KiB)")
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--json", metavar="F", help="write the report (with every sample and loss) here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    show_logs_above_progress()  # the cycles' progress lines
    check = min(args.check_cycles, args.cycles)
    # Room for 2 policy workers + 1 engine; a JAX actor's host devices, as the torch backends' 2 workers.
    RaySession(num_cpus=4).start(JAX_DEVICES if args.backend == "jax_pjit" else None)
    report = soak(
        args.cycles,
        args.backend,
        args.transport,
        min(args.warmup, args.cycles - 1),
        args.sample_every,
        check,
        args.seed,
        args.bucket_kb * 1024,
        args.max_growth_pct,
    )
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = report["memory_ok"] and report["losses_bitwise_equal"] and report["engine_probe_bitwise_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
