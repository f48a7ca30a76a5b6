"""``dualrl bench`` on HF, two torch layouts and the JAX layouts, throughput only.

    python -m benchmarks.jax_backend [dualrl bench options]
        = dualrl bench --sections throughput --layouts <LAYOUTS below> --model llama_bench --seq 256

How a JAX layout runs (one actor owning the mesh's XLA host devices, its threads pinned,
compile counts): ``benchmarks.lib.policy``; its host devices and the Ray restarts between
device counts: ``benchmarks.lib.ray_session``.
"""

from __future__ import annotations

import sys

from benchmarks.compare import main as bench_main

LAYOUTS = ["fsdp1-dp1", "dtensor-dp2", "jax-fsdp2", "jax-tp2", "jax-fsdp1"]


def main(argv: list[str] | None = None) -> int:
    rest = argv if argv is not None else sys.argv[1:]
    return bench_main(
        ["--sections", "throughput", "--layouts", *LAYOUTS, "--model", "llama_bench", "--seq", "256", *rest],
        prog="python -m benchmarks.jax_backend",
    )


if __name__ == "__main__":
    sys.exit(main())
