"""Profiling and shutdown of every backend's worker: the engine starts and stops its own
profiler; where traces go, the one-trace-at-a-time bookkeeping and the order of a shutdown are
written here once."""

from __future__ import annotations

import abc
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any


class WorkerDiagnostics(abc.ABC):
    """``start_gpu_profiling`` / ``stop_gpu_profiling`` and ``shutdown`` (mixed into ``PolicyWorkerBase``)."""

    rank: int
    _profiler: Any = None  # the running trace's handle (the engine's), None when no trace runs

    def start_gpu_profiling(self) -> None:
        """Start the engine's profiler trace, to be written under ``$DUALRL_PROFILE_DIR``."""
        self._profiler = self._start_profiler(self._profile_root())

    def stop_gpu_profiling(self) -> str | None:
        """Stop the trace and write it (one file or directory per rank); returns its path, or
        None when no trace was running."""
        if self._profiler is None:
            return None
        handle, self._profiler = self._profiler, None
        return self._stop_profiler(handle)

    @staticmethod
    def _profile_root() -> Path:
        """Where profiler traces go: ``$DUALRL_PROFILE_DIR`` (default ``./profiles``), absolute."""
        return Path(os.environ.get("DUALRL_PROFILE_DIR", "profiles")).resolve()

    def shutdown(self) -> bool:
        """Release the refit stream (the group ``ray.kill()``s the actor next: exit handlers
        never run), then leave the process group; True."""
        self.finish_refit_stream()
        self._leave_process_group()
        return True

    # ------------------------------------------------------------------ engine hooks
    @abc.abstractmethod
    def _start_profiler(self, root: Path) -> Any:
        """Start a trace whose output goes under ``root``; returns its handle."""

    @abc.abstractmethod
    def _stop_profiler(self, handle: Any) -> str:
        """Stop the trace ``handle`` and write it; returns the path written."""

    @abc.abstractmethod
    def _leave_process_group(self) -> None:
        """Leave the engine's distributed runtime (all workers call this together)."""

    if TYPE_CHECKING:  # core.refit.sender.RefitSender's

        def finish_refit_stream(self) -> None: ...
