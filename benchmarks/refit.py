"""``dualrl bench`` on one layout per backend, refit only (policy weights -> one vLLM engine).

    python -m benchmarks.refit [dualrl bench options]
        = dualrl bench --sections refit --layouts fsdp1-dp2 dtensor-tp2 jax-fsdp2 --model llama_bench

The engine, the transports, the memcpy baseline and the methodology: ``benchmarks.lib.refit``.
"""

from __future__ import annotations

import sys

from benchmarks.compare import main as bench_main

LAYOUTS = ["fsdp1-dp2", "dtensor-tp2", "jax-fsdp2"]


def main(argv: list[str] | None = None) -> int:
    rest = argv if argv is not None else sys.argv[1:]
    return bench_main(
        ["--sections", "refit", "--layouts", *LAYOUTS, "--model", "llama_bench", *rest],
        prog="python -m benchmarks.refit",
    )


if __name__ == "__main__":
    sys.exit(main())
