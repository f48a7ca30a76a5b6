"""Running a test body on ``world`` spawned CPU processes joined by a gloo group.

Each rank reports once through a queue (an error's traceback, or whatever the body returns),
and the parent fails -- never hangs -- when a rank dies without reporting or the spawn
overruns its deadline.  The group's own timeout turns a desynchronised collective into an
error of the rank that waits, instead of a hang.
"""

from __future__ import annotations

import queue as queue_lib
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

SPAWN_TIMEOUT_S = 120
GLOO_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = GLOO_TIMEOUT_S) -> None:
    """In a child: join the group on ``port``, one intra-op thread (the ranks share few cores)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _rank_main(target: Callable, *args: Any) -> None:
    """A spawned rank: the body, then the group's teardown.  A process that exits with its gloo
    group alive may abort in the group's threads' destructors ("terminate called without an
    active exception", exit code -6) after it has reported, so every rank tears it down here."""
    import torch.distributed as dist

    try:
        target(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(target: Callable, world: int, args: tuple = (), timeout_s: float = SPAWN_TIMEOUT_S) -> dict[int, Any]:
    """Spawn ``target(rank, world, port, results, *args)`` on ``world`` processes; each must put
    ``(rank, report)`` on ``results`` once.  -> ``{rank: report}``.  ``target`` must be a
    module-level function (the processes are spawned, not forked); the group a body joins with
    :func:`init_gloo` is destroyed when it returns."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(target, rank, world, port, results, *args), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    reports: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < world and time.monotonic() < deadline:
            try:
                rank, report = results.get(timeout=0.5)
                reports[rank] = report
            except queue_lib.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"a rank exited with code {dead[0]} without reporting") from None
        if len(reports) < world:
            raise AssertionError(f"only ranks {sorted(reports)} of {world} reported within {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    assert not bad, f"ranks exited non-zero (rank, code): {bad}"
    return reports
