"""Wall-clock accounting of a training step's phases (``timing/<phase>_s`` metrics)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator


class StepTimer:
    """``with timer("generation"): ...`` adds the block's seconds to the phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """Each phase as ``timing/<phase>_s`` plus the whole step as ``step_time_s``."""
        out = {f"timing/{phase}_s": s for phase, s in self.seconds.items()}
        out["step_time_s"] = time.perf_counter() - self._start
        return out
