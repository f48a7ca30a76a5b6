"""``dualrl bench`` on the torch layouts, throughput only (HF eager and each layout's Policy).

    python -m benchmarks.torch_backends [dualrl bench options]
        = dualrl bench --sections throughput --layouts <TORCH_LAYOUTS> --model llama_bench --seq 256

(``TORCH_LAYOUTS``: ``benchmarks.lib.parity.settings``.)

The runners and their methodology: ``benchmarks.lib.hf`` (the HF eager child),
``benchmarks.lib.policy`` (the Policy cases, threads) and ``benchmarks.lib.pairing`` (every
Policy call paired with an HF call).
"""

from __future__ import annotations

import sys

from benchmarks.compare import main as bench_main
from benchmarks.lib.parity.settings import TORCH_LAYOUTS as LAYOUTS


def main(argv: list[str] | None = None) -> int:
    rest = argv if argv is not None else sys.argv[1:]
    return bench_main(
        ["--sections", "throughput", "--layouts", *LAYOUTS, "--model", "llama_bench", "--seq", "256", *rest],
        prog="python -m benchmarks.torch_backends",
    )


if __name__ == "__main__":
    sys.exit(main())
