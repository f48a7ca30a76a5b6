"""``collective`` transport: trainer rank 0 broadcasts buckets to the engine's workers.

A stateless process group (its own TCPStore, not ``torch.distributed``'s default group, which
the trainer already uses for FSDP) joins training rank 0 (group rank 0) and every engine
worker (ranks 1..n): gloo on CPU, NCCL on GPU.  The stream is self-describing: each bucket is
a header (its slots as JSON) followed by the packed bytes, and an empty header ends it, so a
receiver can check every bucket against the manifest and notice an incomplete stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from core.refit.packing import Slot, pack_into, plan_layout, unpack

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class RefitGroup:
    """The broadcast group and the device its buffers live on (gloo: CPU, NCCL: the GPU)."""

    pg: C10dBackend  # a stateless gloo / NCCL backend, outside torch.distributed's groups
    device: torch.device
    rank: int


def init_group(
    host: str, port: int, rank: int, world_size: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> RefitGroup:
    """Join the weight-broadcast group; blocks until all ``world_size`` ranks have joined."""
    if not 0 <= rank < world_size:
        raise ValueError(f"refit group rank {rank} outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(
        "dualrl-refit", dist.TCPStore(host, int(port), world_size, is_master=(rank == 0), timeout=timeout)
    )
    pg: C10dBackend
    if device.type == "cuda":
        pg = dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
    else:
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return RefitGroup(pg, device, rank)


def _broadcast(group: RefitGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    # torch's stub of the c10d Backend leaves out its collectives (broadcast is there at run time).
    group.pg.broadcast([tensor], opts).wait()  # type: ignore[attr-defined]


def _send_header(group: RefitGroup, slots: Sequence[Slot] | None, total: int, device: torch.device) -> None:
    text = b"" if slots is None else json.dumps({"total": total, "slots": [s.to_list() for s in slots]}).encode()
    size = torch.tensor([len(text)], dtype=torch.int64, device=device)
    _broadcast(group, size)
    if text:
        _broadcast(group, torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device))


class ReceiverLost(RuntimeError):
    """A broadcast failed (a receiving engine died or left the group) part-way through the
    stream; the sender still produced every bucket, so its training peers are in step."""


def send_buckets(group: RefitGroup, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int:
    """Rank 0: broadcast every bucket, then the end marker.  Returns the bytes sent.

    ``buckets`` is consumed to the end even after a broadcast failed: producing a bucket is a
    gather the other training ranks run too, and a rank that stopped early would leave them
    blocked in it.  Then :class:`ReceiverLost` is raised.
    """
    device = group.device
    sent = 0
    lost: BaseException | None = None
    try:
        for items in buckets:
            if lost is not None:
                continue
            try:
                sent += _send_bucket(group, items, device)
            except Exception as exc:  # noqa: BLE001 - the receivers' side of the group broke
                lost = exc
    finally:
        # Also when producing a bucket failed: the receivers stop waiting, notice the
        # stream is incomplete and mark the engine stale, instead of blocking until timeout.
        if lost is None:
            _send_header(group, None, 0, device)
    if lost is not None:
        raise ReceiverLost(f"the weight broadcast failed after {sent} bytes: {type(lost).__name__}: {lost}") from lost
    return sent


def _send_bucket(group: RefitGroup, items: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> int:
    slots, total = plan_layout(items)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    pack_into(buffer, slots, items)
    _send_header(group, slots, total, device)
    _broadcast(group, buffer)
    return total


def receive_buckets(group: RefitGroup) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine ranks: yield each received bucket as views into a fresh buffer, until the end marker.

    The consumer must exhaust the iterator even after it stops loading (e.g. a bad bucket),
    or rank 0 blocks in its next broadcast: ``drain`` does that.
    """
    device = group.device
    while True:
        size = torch.zeros(1, dtype=torch.int64, device=device)
        _broadcast(group, size)
        if int(size.item()) == 0:
            return
        text = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        _broadcast(group, text)
        header = json.loads(text.cpu().numpy().tobytes().decode())
        buffer = torch.empty(int(header["total"]), dtype=torch.uint8, device=device)
        _broadcast(group, buffer)
        yield unpack(buffer, [Slot.from_list(s) for s in header["slots"]])


def drain(buckets: Iterator) -> None:
    for _ in buckets:
        pass


def destroy(group: RefitGroup | None) -> None:
    if group is not None and hasattr(group.pg, "shutdown"):
        try:
            group.pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort on teardown
            pass
