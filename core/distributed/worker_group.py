"""One Ray actor per bundle of a :class:`RayVirtualCluster`, driven as a single SPMD group.

NeMo RL's ``RayWorkerGroup``, with three differences that matter in practice:

* ranks are described by a :class:`WorkerLayout` (named axes such as ``dp``/``cp``/``tp``)
  instead of a separate sharding annotation object;
* :meth:`RayWorkerGroup.get_all_worker_results` fails fast: the first failed call (an
  exception in the method or a dead actor) raises :class:`WorkerGroupError` and kills
  the group, instead of ``ray.get`` blocking forever on the ranks that are stuck in a
  collective waiting for the dead one -- unless the failure is recoverable
  (:mod:`core.distributed.recoverable`: raised before any collective, on every failed rank,
  and every other rank finished): then :class:`RecoverableCallError` and the group lives;
* every error names the method, the rank(s) and the cause; a worker that died in its
  constructor gives :class:`WorkerStartupError`, whose first line names the rank, its
  node/bundle, the exception the constructor raised and the project line that raised it
  (the alternative is Ray's "the actor died because of an error raised in its creation
  task" with the cause somewhere in the worker's log).

Around it: :mod:`core.distributed.layout` (:class:`WorkerLayout`),
:mod:`core.distributed.actor_placement` (one actor per bundle, the rank env vars),
:mod:`core.distributed.errors` (the exceptions) and :mod:`core.distributed.startup_failure`
(reading a constructor's exception off Ray's error).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from core.distributed.actor_placement import check_env_vars, check_workers_per_node, create_actors, kill_actors
from core.distributed.errors import RecoverableCallError, WorkerGroupError, WorkerStartupError
from core.distributed.layout import WorkerLayout
from core.distributed.recoverable import recoverable_cause
from core.distributed.startup_failure import StartupFailure, plain_indent, startup_failure
from core.distributed.virtual_cluster import RayVirtualCluster

__all__ = ["RayWorkerGroup", "ShardedFuture"]


#: After a rank's recoverable failure, how long its peers get to finish the same call
#: before they are taken to be blocked in a collective (validation takes milliseconds).
RECOVER_GRACE_S = 10.0


# ====================================================================== futures
@dataclass(frozen=True)
class ShardedFuture:
    """The futures of one :meth:`RayWorkerGroup.run_all_workers_sharded_data` call.

    ``futures[i]`` is rank ``ranks[i]``'s call (every rank is called);
    ``keep`` lists the indices into ``futures`` whose outputs are returned, in shard order.
    """

    method_name: str
    futures: list[ray.ObjectRef]
    ranks: list[int]
    keep: list[int] = field(default_factory=list)


class _CallRegistry:
    """Which rank and method each pending ObjectRef belongs to, so that an error raised
    from a plain ``list[ObjectRef]`` can still name them.

    Keyed by the ref's hex id rather than the ref itself: holding the ref would keep its
    result pinned in the object store.  Bounded (oldest entries dropped) because callers
    may never hand some futures back to :meth:`RayWorkerGroup.get_all_worker_results`.
    """

    def __init__(self, capacity: int = 16384) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, tuple[int, str]] = OrderedDict()

    def add(self, ref: ray.ObjectRef, rank: int, method: str) -> None:
        self._entries[ref.hex()] = (rank, method)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def lookup(self, ref: ray.ObjectRef) -> tuple[int | None, str]:
        return self._entries.get(ref.hex(), (None, "?"))

    def discard(self, refs: Iterable[ray.ObjectRef]) -> None:
        for ref in refs:
            self._entries.pop(ref.hex(), None)


# ====================================================================== group
class RayWorkerGroup:
    """One actor of ``worker_cls`` per used bundle of ``cluster``, rank = bundle order.

    Args:
        cluster: where to place the actors.
        worker_cls: a plain class (wrapped with ``ray.remote`` here) or a Ray actor class.
        *worker_args, **worker_kwargs: passed to every worker's constructor.
        name_prefix: actors are named ``f"{name_prefix}-{rank}"`` (unique per Ray namespace).
        workers_per_node: ``None`` = every bundle; ``int`` = that many (the first ones) on
            every node; ``list`` = one count per node.  Counts may not exceed a node's bundles
            (x ``actors_per_bundle``).
        actors_per_bundle: workers sharing each bundle (consecutive ranks, each with that
            share of its CPUs / GPUs); default one per bundle.
        env_vars: extra env vars for every worker (may not override the rank variables).
        layout: rank -> coordinates; default ``WorkerLayout({"dp": world_size})``.

    Every worker gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (a fresh port from
    ``cluster.get_master_address_and_port()``), so ``torch.distributed.init_process_group``
    with the default ``env://`` works as is.  On CPU bundles ``CUDA_VISIBLE_DEVICES=""``
    keeps a stray CUDA initialisation from grabbing a GPU of the host.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        worker_cls: type,
        *worker_args: Any,
        name_prefix: str = "worker",
        workers_per_node: int | list[int] | None = None,
        env_vars: Mapping[str, str] | None = None,
        layout: WorkerLayout | None = None,
        actors_per_bundle: int = 1,
        **worker_kwargs: Any,
    ) -> None:
        env_vars = check_env_vars(env_vars)
        self._cluster = cluster
        self._name_prefix = name_prefix
        self._counts = check_workers_per_node(cluster.bundle_ct_per_node_list, workers_per_node, actors_per_bundle)
        world_size = sum(self._counts)
        self._layout = layout if layout is not None else WorkerLayout.data_parallel(world_size)
        if self._layout.world_size != world_size:
            raise ValueError(
                f"RayWorkerGroup: {self._layout} has {self._layout.world_size} ranks but the group "
                f"has {world_size} workers ({self._counts} per node)"
            )
        self._registry = _CallRegistry()
        self._dead_reason: str | None = None
        #: Seconds the other ranks get to finish after a recoverable failure (see _wait_all).
        self.recover_grace_s = RECOVER_GRACE_S
        #: The actor of every rank, and its (node rank, bundle index) for error messages.
        self._workers, self._placement = create_actors(
            cluster, worker_cls, worker_args, worker_kwargs, env_vars, self._counts, name_prefix, actors_per_bundle
        )

    # ------------------------------------------------------------------ description
    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        """Actor handles, index = rank (a copy)."""
        return list(self._workers)

    @property
    def world_size(self) -> int:
        return len(self._workers)

    # ------------------------------------------------------------------ calls
    def run_all_workers_single_data(self, method_name: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method_name(*args, **kwargs)`` on every worker; one future per rank."""
        self._check_alive(method_name)
        return [self._call(rank, method_name, args, kwargs) for rank in range(self.world_size)]

    def run_all_workers_sharded_data(
        self,
        method_name: str,
        data: Sequence[Any],
        in_sharded_axes: Sequence[str] = ("dp",),
        replicate_on_axes: Sequence[str] = ("cp", "tp"),
        output_is_replicated: Sequence[str] = ("cp", "tp"),
        common_kwargs: Mapping[str, Any] | None = None,
    ) -> ShardedFuture:
        """Call ``method_name(shard, **common_kwargs)`` on every worker, where ``shard`` is
        ``data[c0][c1]...`` for the worker's coordinates ``c0, c1, ...`` on ``in_sharded_axes``
        (so with one sharded axis, ``data[i]`` goes to every rank with coordinate ``i``).

        * ``data`` is nested once per sharded axis; each level's length must equal the
          axis size.
        * every layout axis of size > 1 must be sharded or in ``replicate_on_axes``
          (ranks on a replicated axis get the same shard); axes named in
          ``replicate_on_axes`` / ``output_is_replicated`` that the layout lacks are ignored,
          so the defaults work with a plain ``dp`` layout.
        * the returned future keeps the outputs of the ranks with coordinate 0 on every
          ``output_is_replicated`` axis, ordered by their sharded coordinates (shard order,
          row-major over ``in_sharded_axes``), then by rank.
        """
        self._check_alive(method_name)
        sharded = self._check_sharding(method_name, in_sharded_axes, replicate_on_axes)
        _check_nested_lengths(method_name, data, [(a, self._layout.axis_size(a)) for a in sharded])
        common_kwargs = dict(common_kwargs or {})
        kept_axes = [a for a in output_is_replicated if self._layout.has_axis(a)]

        # Each shard goes into the object store once, however many replicas receive it;
        # Ray resolves a top-level ObjectRef argument to its value before the call.
        shard_refs: dict[tuple[int, ...], Any] = {}
        futures, keep_keys = [], []
        for rank in range(self.world_size):
            coords = self._layout.coords(rank)
            key = tuple(coords[a] for a in sharded)
            if key not in shard_refs:
                shard_refs[key] = ray.put(_nested_get(data, key))
            futures.append(self._call(rank, method_name, (shard_refs[key],), common_kwargs))
            if all(coords[a] == 0 for a in kept_axes):
                keep_keys.append((key, rank))
        keep = [rank for _, rank in sorted(keep_keys)]  # index into futures == rank
        return ShardedFuture(method_name, futures, list(range(self.world_size)), keep)

    def get_all_worker_results(
        self,
        future_or_list: ShardedFuture | Sequence[ray.ObjectRef] | ray.ObjectRef,
        timeout: float | None = None,
    ) -> list[Any]:
        """Wait for the futures and return their results (for a :class:`ShardedFuture`,
        only the kept outputs, in shard order; otherwise one per future, in order).

        Fails fast: as soon as any call has failed (the method raised, or the actor died)
        it kills this group's actors (ranks blocked in a collective with the failed one
        would otherwise hang forever) and raises :class:`WorkerGroupError` naming the
        method, the failed rank(s) and the cause; it does not wait for the other ranks.
        ``timeout`` seconds without every call finished: :class:`WorkerGroupError` naming
        the unfinished ranks (the actors are left alive; call :meth:`shutdown`).
        """
        refs, ranks, method, keep = self._unpack(future_or_list)
        results = self._wait_all(refs, ranks, method, timeout)
        self._registry.discard(refs)
        return [results[i] for i in keep] if keep is not None else results

    # ------------------------------------------------------------------ teardown
    def shutdown(self, cleanup_method: str | None = None, timeout: float = 30.0) -> bool:
        """Optionally call ``cleanup_method()`` on every worker (waiting at most ``timeout``
        seconds in total), then kill every actor.  Idempotent.

        Returns True if the cleanup calls all succeeded (or none was requested, or the group
        was already shut down), False if any failed, did not finish in time, or could not run
        because the actors had been killed after a failure; the actors are killed in every case.
        """
        if not self._workers:
            return True
        try:
            if cleanup_method is None:
                return True
            if self._dead_reason is not None:
                return False  # the actors were already killed: the cleanup cannot run any more
            return self._run_cleanup(cleanup_method, timeout)
        finally:  # also when cleanup_method does not exist: never leave actors behind
            self._kill_all("the group was shut down")
            self._workers = []

    def _run_cleanup(self, cleanup_method: str, timeout: float) -> bool:
        """Call ``cleanup_method()`` on every worker; True iff all finished without error
        within ``timeout`` seconds."""
        refs = [self._call(rank, cleanup_method, (), {}) for rank in range(self.world_size)]
        ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        ok = not not_ready
        for ref in ready:
            try:
                ray.get(ref)
            except RayError:
                ok = False
        self._registry.discard(refs)
        return ok

    def __repr__(self) -> str:
        return f"RayWorkerGroup({self._name_prefix!r}, {self._layout}, workers per node {self._counts})"

    # ------------------------------------------------------------------ internals: calls
    def _call(self, rank: int, method_name: str, args: tuple, kwargs: Mapping[str, Any]) -> ray.ObjectRef:
        try:
            method = getattr(self._workers[rank], method_name)
        except AttributeError:
            raise AttributeError(
                f"RayWorkerGroup({self._name_prefix!r}): workers have no method {method_name!r}"
            ) from None
        ref = method.remote(*args, **kwargs)
        self._registry.add(ref, rank, method_name)
        return ref

    def _check_alive(self, method_name: str) -> None:
        if self._dead_reason is not None:
            raise WorkerGroupError(
                f"RayWorkerGroup({self._name_prefix!r}): cannot call {method_name!r}: the group's "
                f"actors were killed ({self._dead_reason})",
                method=method_name,
            )

    def _check_sharding(
        self, method_name: str, in_sharded_axes: Sequence[str], replicate_on_axes: Sequence[str]
    ) -> list[str]:
        """Validate the axis roles against the layout; return the sharded axes."""
        where = f"run_all_workers_sharded_data({method_name!r})"
        if isinstance(in_sharded_axes, str) or isinstance(replicate_on_axes, str):
            raise TypeError(f"{where}: axis arguments are sequences of names, e.g. ('dp',), not a string")
        sharded = list(in_sharded_axes)
        if not sharded:
            raise ValueError(f"{where}: in_sharded_axes is empty; use run_all_workers_single_data")
        for axis in sharded:
            if not self._layout.has_axis(axis):
                raise ValueError(f"{where}: sharded axis {axis!r} is not in {self._layout}")
        both = sorted(set(sharded) & set(replicate_on_axes))
        if both:
            raise ValueError(f"{where}: axes {both} are both sharded and replicated")
        unassigned = [
            a
            for a in self._layout.axis_names
            if self._layout.axis_size(a) > 1 and a not in sharded and a not in replicate_on_axes
        ]
        if unassigned:
            raise ValueError(
                f"{where}: axes {unassigned} of {self._layout} are neither in in_sharded_axes "
                f"{tuple(sharded)} nor in replicate_on_axes {tuple(replicate_on_axes)}"
            )
        return sharded

    def _unpack(
        self, future_or_list: ShardedFuture | Sequence[ray.ObjectRef] | ray.ObjectRef
    ) -> tuple[list[ray.ObjectRef], list[int | None], str, list[int] | None]:
        """(refs, rank per ref, method name, indices to keep or None for all)."""
        if isinstance(future_or_list, ShardedFuture):
            f = future_or_list
            return list(f.futures), list(f.ranks), f.method_name, list(f.keep)
        if isinstance(future_or_list, ray.ObjectRef):
            refs = [future_or_list]
        else:
            refs = list(future_or_list)
        looked_up = [self._registry.lookup(r) for r in refs]
        methods = sorted({m for _, m in looked_up if m != "?"})
        method = "/".join(methods) if methods else "?"
        return refs, [rank for rank, _ in looked_up], method, None

    def _wait_all(
        self, refs: list[ray.ObjectRef], ranks: list[int | None], method: str, timeout: float | None
    ) -> list[Any]:
        """Results of ``refs`` in order; raise on the first fatal failure, on the deadline,
        or -- after every call has finished -- for recoverable failures."""
        positions: dict[str, list[int]] = {}
        unique: list[ray.ObjectRef] = []
        for i, ref in enumerate(refs):  # ray.wait rejects duplicate refs
            if ref.hex() not in positions:
                positions[ref.hex()] = []
                unique.append(ref)
            positions[ref.hex()].append(i)
        results: list[Any] = [None] * len(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        recovered: dict[int | None, BaseException] = {}
        grace_end: float | None = None  # set by the first recoverable failure
        pending = unique
        while pending:
            ends = [t for t in (deadline, grace_end) if t is not None]
            remaining = None if not ends else max(0.0, min(ends) - time.monotonic())
            # num_returns=1: wake up on the *first* finished call, so a failure is seen at once
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                unfinished = sorted({ranks[positions[r.hex()][0]] for r in pending}, key=_rank_key)
                if recovered:
                    self._fail_stranded(method, recovered, unfinished)
                raise WorkerGroupError(
                    f"RayWorkerGroup({self._name_prefix!r}): {method!r} did not finish within "
                    f"{timeout} s on rank(s) {_fmt_ranks(unfinished)}",
                    method=method,
                    ranks=[r for r in unfinished if r is not None],
                )
            if pending:  # collect everything else that is already done, without blocking
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                ready = ready + more
            failures: dict[int | None, BaseException] = {}
            for ref in ready:
                idx = positions[ref.hex()]
                try:
                    value = ray.get(ref)
                except RayError as err:
                    failures[ranks[idx[0]]] = err
                    continue
                for i in idx:
                    results[i] = value
            if failures and all(recoverable_cause(e) is not None for e in failures.values()):
                # The other ranks either fail the same way or finish; one still running after
                # the grace period is blocked in a collective waiting for a failed rank.
                recovered.update(failures)
                grace_end = grace_end or time.monotonic() + self.recover_grace_s
            elif failures:
                self._fail(method, {**recovered, **failures})
        if recovered:
            self._raise_recoverable(method, recovered)
        return results

    def _error(
        self, cls: type, method: str, failures: Mapping[int | None, BaseException], text: str, describe: Any = None
    ) -> WorkerGroupError:
        """``cls`` with ``text`` (after the group's name), then one line per failed rank."""
        failed = sorted(failures, key=_rank_key)
        describe = describe or _describe
        details = "\n".join(f"  rank {_fmt_rank(r)}: {describe(failures[r])}" for r in failed)
        return cls(
            f"RayWorkerGroup({self._name_prefix!r}): {text}\n{details}",
            method=method,
            ranks=[r for r in failed if r is not None],
            errors={r: e for r, e in failures.items() if r is not None},
        )

    def _raise_recoverable(self, method: str, failures: Mapping[int | None, BaseException]) -> None:
        failed = sorted(failures, key=_rank_key)
        raise self._error(
            RecoverableCallError,
            method,
            failures,
            f"{method!r} failed on rank(s) {_fmt_ranks(failed)}: {_recoverable_text(failures[failed[0]])}\n"
            f"Recoverable: every failed rank raised before any collective (or kept its peers in step) and "
            f"every other rank finished; the group's {len(self._workers)} actors are alive and usable.",
            _recoverable_text,
        ) from failures[failed[0]]

    def _fail_stranded(
        self, method: str, failures: Mapping[int | None, BaseException], stranded: Sequence[int | None]
    ) -> None:
        """Recoverable failures on some ranks, but others never finished: those are blocked in
        a collective the failed ranks will not join, so the group cannot go on."""
        failed = sorted(failures, key=_rank_key)
        self._kill_all(
            f"{method!r} failed on rank(s) {_fmt_ranks(failed)} while rank(s) "
            f"{_fmt_ranks(stranded)} were in a collective"
        )
        raise self._error(
            WorkerGroupError,
            method,
            failures,
            f"{method!r} failed on rank(s) {_fmt_ranks(failed)} before any collective, but rank(s) "
            f"{_fmt_ranks(stranded)} had not finished {self.recover_grace_s:g} s later (blocked in a collective "
            f"waiting for the failed ranks). Fatal: all {len(self._workers)} actors of the group were killed.",
            _recoverable_text,
        ) from failures[failed[0]]

    def _fail(self, method: str, failures: Mapping[int | None, BaseException]) -> None:
        """Kill the group and raise a WorkerGroupError describing ``failures``
        (a :class:`WorkerStartupError` when a worker died in its constructor)."""
        failed = sorted(failures, key=_rank_key)
        startup = {r: s for r in failed if (s := startup_failure(failures[r])) is not None}
        if startup:
            self._fail_startup(method, failures, startup)
        self._kill_all(f"{method!r} failed on rank(s) {_fmt_ranks(failed)}")
        died = any(isinstance(failures[r], RayActorError) for r in failed)
        why = (
            "a worker process died"
            if died
            else "an exception inside or after a collective (its peers may be blocked in it)"
        )
        raise self._error(
            WorkerGroupError,
            method,
            failures,
            f"{method!r} failed on rank(s) {_fmt_ranks(failed)}. Fatal ({why}): all {len(self._workers)} actors "
            "of the group were killed.",
        ) from failures[failed[0]]

    def _fail_startup(
        self,
        method: str,
        failures: Mapping[int | None, BaseException],
        startup: Mapping[int | None, StartupFailure],
    ) -> None:
        """Kill the group and raise :class:`WorkerStartupError`: first line = the first rank
        whose constructor raised, with the cause and its location; then every failed rank."""
        failed = sorted(failures, key=_rank_key)
        started = sorted(startup, key=_rank_key)
        self._kill_all(f"rank(s) {_fmt_ranks(started)} failed to start")
        first_rank = started[0]
        first = startup[first_rank]
        others = [r for r in started if r != first_rank]
        more = f" (and rank(s) {_fmt_ranks(others)})" if others else ""
        details = []
        for r in failed:
            s = startup.get(r)
            if s is None:
                details.append(f"  rank {_fmt_rank(r)}: {_describe(failures[r])}")
            else:
                details.append(f"  rank {_fmt_rank(r)}{self._where(r, s)}: {s.describe()}")
        raise WorkerStartupError(
            f"RayWorkerGroup({self._name_prefix!r}): rank {_fmt_rank(first_rank)}{self._bundle(first_rank)}{more} "
            f"failed to start: "
            f"{first.summary()}; all {len(self._workers)} actors of the group were killed.\n" + "\n".join(details),
            method=method,
            ranks=[r for r in failed if r is not None],
            errors={r: e for r, e in failures.items() if r is not None},
            failures={r: s for r, s in startup.items() if r is not None},
        ) from failures[first_rank]

    def _bundle(self, rank: int | None) -> str:
        """`` (node N, bundle B)`` of ``rank``; "" if unknown."""
        if rank is None or not 0 <= rank < len(self._placement):
            return ""
        node, bundle = self._placement[rank]
        return f" (node {node}, bundle {bundle})"

    def _where(self, rank: int | None, failure: StartupFailure) -> str:
        """`` (node N, bundle B, ip, pid)`` of ``rank``, as far as known."""
        parts = []
        if rank is not None and 0 <= rank < len(self._placement):
            node, bundle = self._placement[rank]
            parts += [f"node {node}", f"bundle {bundle}"]
        if failure.ip:
            parts.append(f"ip {failure.ip}")
        if failure.pid:
            parts.append(f"pid {failure.pid}")
        return f" ({', '.join(parts)})" if parts else ""

    def _kill_all(self, reason: str) -> None:
        """``ray.kill`` every actor (no restart); remember why, for later calls."""
        if self._dead_reason is None:
            self._dead_reason = reason
        kill_actors(self._workers)


# ====================================================================== helpers
def _check_nested_lengths(method: str, data: Any, axes: list[tuple[str, int]], path: str = "data") -> None:
    """``data`` must be a list (or tuple) of ``axes[0]`` size, each item one of ``axes[1]``...."""
    if not axes:
        return
    (axis, size), rest = axes[0], axes[1:]
    if not isinstance(data, (list, tuple)):
        raise TypeError(
            f"run_all_workers_sharded_data({method!r}): {path} must be a list with one item per "
            f"{axis!r} coordinate ({size}), e.g. BatchedDataDict.shard_by_batch_size({size}); "
            f"got {type(data).__name__}"
        )
    if len(data) != size:
        raise ValueError(
            f"run_all_workers_sharded_data({method!r}): len({path}) is {len(data)} but sharded "
            f"axis {axis!r} has size {size}"
        )
    for i, item in enumerate(data):
        _check_nested_lengths(method, item, rest, f"{path}[{i}]")


def _nested_get(data: Any, key: tuple[int, ...]) -> Any:
    for i in key:
        data = data[i]
    return data


def _describe(err: BaseException) -> str:
    """The worker's own exception for a method error (plus its remote traceback), Ray's
    explanation for a dead actor."""
    if isinstance(err, RayTaskError) and err.cause is not None:
        cause = err.cause
        return f"{type(cause).__name__}: {cause}\n    remote traceback:\n{plain_indent(str(err), 6)}"
    return f"{type(err).__name__}: {plain_indent(str(err), 4).lstrip()}"


def _recoverable_text(err: BaseException) -> str:
    """``Type: message`` of the worker exception behind a recoverable failure."""
    cause = recoverable_cause(err) or err
    return f"{type(cause).__name__}: {cause}"


def _rank_key(rank: int | None) -> tuple[int, int]:
    return (1, 0) if rank is None else (0, rank)


def _fmt_rank(rank: int | None) -> str:
    return "?" if rank is None else str(rank)


def _fmt_ranks(ranks: Iterable[int | None]) -> str:
    return "[" + ", ".join(_fmt_rank(r) for r in ranks) + "]"
