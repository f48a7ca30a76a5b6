"""The JAX worker's runtime around its steps: joining the multi-host runtime, what several
processes refuse at start-up, the block every jitted step runs in (mesh, activation
sharding, matmul precision), and what the worker reports of its devices."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import Mesh

from backends.jax_pjit.logical_axes import DECODE_RULES, RULES
from backends.jax_pjit.models.layers import activation_constraint
from backends.jax_pjit.sharding import activation_constraint as make_constraint
from backends.jax_pjit.sharding import check_process_rows
from core.policy.config import PolicyConfig


def init_jax_distributed() -> None:
    """Join the multi-host runtime when the worker group has more than one host."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize(
            coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            num_processes=world,
            process_id=int(os.environ["RANK"]),
        )


def check_multi_process(cfg: PolicyConfig, mesh: Mesh, packing: bool) -> None:
    """Several JAX processes: refuse at start-up, naming the field, what is not supported
    across processes yet (it would run on each process's rows as if they were the whole
    batch); and a mesh on which a process does not own whole fsdp rows."""
    n = jax.process_count()
    if n == 1:
        return
    check_process_rows(mesh)
    unsupported = []
    if int(mesh.shape["cp"]) > 1:
        unsupported.append(f"policy.parallel.context_parallel_size={int(mesh.shape['cp'])} (context parallelism)")
    if packing:
        unsupported.append("policy.sequence_packing.enabled=true (sequence packing)")
    if cfg.generation is not None and cfg.generation.backend == "hf":
        unsupported.append("policy.generation.backend='hf' (generation on the policy workers)")
    if unsupported:
        raise ValueError(
            f"multi-process JAX ({n} processes) does not support {'; '.join(unsupported)} "
            "yet: use one JAX process (one node) for it"
        )


@contextlib.contextmanager
def on_mesh(mesh: Mesh, matmul_precision: str, decode: bool = False) -> Iterator[None]:
    """The mesh, its activation-sharding hook and the matmul precision; ``decode``: the
    sequence replicated (``DECODE_RULES``: KV-cache decoding feeds one token per row,
    which cp cannot split).

    Every jitted step of the worker runs inside this block (it needs the mesh), so the
    precision reaches every program, a new step's too: ``jax.default_matmul_precision``
    is read when a step is traced and is part of jit's cache key, so each dot_general is
    lowered with ``policy.matmul_precision`` (``highest``: true fp32 on GPU, where JAX's
    default is TF32-class)."""
    if decode and jax.process_count() > 1:  # generate() would decode this host's rows as the global batch
        raise RuntimeError(
            f"generate: multi-process JAX ({jax.process_count()} processes) does not support "
            "generation on the policy workers yet; use policy.generation.backend='vllm'"
        )
    with (
        mesh,
        activation_constraint(make_constraint(mesh, DECODE_RULES if decode else RULES)),
        jax.default_matmul_precision(matmul_precision),
    ):
        yield


def device_id() -> str:
    """``platform:host:pid:device`` of this process's first local device."""
    dev = jax.local_devices()[0]
    return f"{dev.platform}:{socket.gethostname()}:{os.getpid()}:{dev.id}"


def device_info(rank: int, mesh: Mesh) -> dict[str, Any]:
    """This process's devices, its mesh, and the first device's memory counters where XLA has them."""
    devs = jax.local_devices()
    info: dict[str, Any] = {
        "rank": rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device_type": devs[0].platform,
        "local_devices": len(devs),
        "mesh": dict(mesh.shape),
    }
    stats = devs[0].memory_stats() if hasattr(devs[0], "memory_stats") else None
    if stats:
        info.update(memory_in_use_bytes=stats.get("bytes_in_use"), peak_memory_bytes=stats.get("peak_bytes_in_use"))
    return info
