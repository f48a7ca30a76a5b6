"""RayVirtualCluster / RayWorkerGroup / WorkerLayout on a local 4-CPU Ray instance.

Actors cost a process each (~1 s to start on 2 cores), so the tests share groups where
they can (one dp=2 x tp=2 group serves every dispatch test) and use 2-worker groups
elsewhere.  Every cluster and group is shut down by its fixture, so no test leaves
placement groups or actors behind for the next one.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import resource
import socket
import time
from pathlib import Path

import pytest

from core.distributed import (
    RayVirtualCluster,
    RayWorkerGroup,
    RecoverableCallError,
    ResourcesUnavailableError,
    ShardedFuture,
    WorkerGroupError,
    WorkerLayout,
)
from core.distributed.actor_placement import CPU_MALLOC_TUNABLES
from core.policy.backend_spec import device_layout

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "EXTRA_VAR",
    "OMP_NUM_THREADS",
    "GLIBC_TUNABLES",
)


# ---------------------------------------------------------------------- test workers
def _my_rank() -> int:
    return int(os.environ["RANK"])


def _libc() -> ctypes.CDLL:
    """This process's libc, ``malloc`` returning a pointer (ctypes' default ``int`` would truncate it)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    return libc


def _touched_malloc(nbytes: int) -> int:
    """The address of a ``malloc`` of ``nbytes`` with every byte written, so its pages are in."""
    block = _libc().malloc(nbytes)
    ctypes.memset(block, 1, nbytes)
    return block


class ProbeWorker:
    """Tiny worker: reports its environment, echoes, sleeps, dies or raises on request."""

    def __init__(self, tag: str = "probe") -> None:
        self.tag = tag

    def env(self) -> dict:
        return {k: os.environ.get(k) for k in ENV_KEYS}

    def rank(self) -> int:
        return _my_rank()

    def huge_pages_of_a_malloc(self, nbytes: int) -> int:
        """KiB of transparent huge pages this process gained by touching a fresh ``malloc`` of
        ``nbytes`` (a mapping of its own by glibc's defaults; heap growth with a CPU actor's)."""

        def anon_huge_kib() -> int:
            with open("/proc/self/smaps_rollup") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))

        before = anon_huge_kib()
        block = _touched_malloc(nbytes)
        gained = anon_huge_kib() - before
        _libc().free(ctypes.c_void_p(block))
        return gained

    def faults_of_a_second_malloc(self, nbytes: int) -> int:
        """Minor page faults of touching a ``malloc`` of ``nbytes`` made after one of the same
        size was touched and freed (XLA:CPU's temporary buffer of the next execution)."""
        _libc().free(ctypes.c_void_p(_touched_malloc(nbytes)))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = _touched_malloc(nbytes)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        _libc().free(ctypes.c_void_p(block))
        return faults

    def echo(self, x, scale: int = 1) -> dict:
        return {"rank": _my_rank(), "x": x, "scale": scale, "tag": self.tag}

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return _my_rank()

    def die_on(self, rank: int) -> int:
        # the dying rank exits hard (like a segfault / OOM kill); the others "hang"
        if _my_rank() == rank:
            os._exit(1)
        time.sleep(60)
        return _my_rank()

    def raise_on(self, rank: int) -> int:
        if _my_rank() == rank:
            raise ValueError(f"boom from rank {rank}")
        return _my_rank()

    def reject_on(self, rank: int, then_sleep: float = 0.0) -> int:
        """``rank`` fails its input check (before any collective); the others sleep (as if
        they had gone on into a collective) then finish."""
        from core.distributed import before_collectives

        if _my_rank() == rank:
            with before_collectives():
                raise KeyError(f"bad key on rank {rank}")
        time.sleep(then_sleep)
        return _my_rank()

    def cleanup(self) -> str:
        return "cleaned"


class GlooWorker:
    """All-reduces its rank + 1 over a gloo process group built from the env vars alone."""

    def all_reduce(self) -> float:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=60))
        try:
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return t.item()
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------------- fixtures
@pytest.fixture
def make_group(ray_session):
    """Factory ``make_group(bundles, worker_cls=ProbeWorker, **group_kwargs)``; tears down
    every group and cluster it made (groups first, so their actors go before the bundles)."""
    made: list = []

    def factory(bundles, worker_cls=ProbeWorker, **kwargs):
        cluster = RayVirtualCluster(bundles, use_gpus=False)
        made.append(cluster)
        group = RayWorkerGroup(cluster, worker_cls, **kwargs)
        made.append(group)
        return group

    yield factory
    for obj in reversed(made):
        obj.shutdown()


def _assert_dead(ray, actor, within_s: float = 20.0) -> None:
    """``actor`` is (or within a few seconds becomes) dead.  ray.kill is asynchronous: a call
    submitted right after it may still reach the actor, so poll."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.rank.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    pytest.fail(f"{actor} is still alive {within_s} s after being killed")


# ---------------------------------------------------------------------- WorkerLayout (no Ray)
def test_layout_row_major_last_axis_innermost():
    lay = WorkerLayout({"dp": 2, "cp": 1, "tp": 2})
    assert lay.world_size == 4 and lay.axis_names == ("dp", "cp", "tp")
    assert [lay.coords(r) for r in range(4)] == [
        {"dp": 0, "cp": 0, "tp": 0},
        {"dp": 0, "cp": 0, "tp": 1},
        {"dp": 1, "cp": 0, "tp": 0},
        {"dp": 1, "cp": 0, "tp": 1},
    ]
    assert lay.axis_size("tp") == 2 and lay.axis_size("cp") == 1
    assert lay.has_axis("cp") and not lay.has_axis("pp")


def test_layout_matches_torch_device_mesh_order():
    """Same rank -> coordinate map as init_device_mesh's row-major mesh (rank grid)."""
    import numpy as np

    lay = WorkerLayout({"dp": 2, "cp": 3, "tp": 2})
    grid = np.arange(12).reshape(2, 3, 2)  # what DeviceMesh(mesh=arange(ws).view(shape)) holds
    for r in range(12):
        c = lay.coords(r)
        assert grid[c["dp"], c["cp"], c["tp"]] == r


def test_layout_validation_errors():
    with pytest.raises(ValueError, match="unknown axis 'pp'"):
        WorkerLayout({"dp": 2}).axis_size("pp")
    with pytest.raises(ValueError, match="'tp' must have an integer size >= 1"):
        WorkerLayout({"dp": 2, "tp": 0})
    with pytest.raises(ValueError, match="non-empty"):
        WorkerLayout({})
    with pytest.raises(ValueError, match=r"rank 4 is out of range \[0, 4\)"):
        WorkerLayout({"dp": 4}).coords(4)


def test_torch_layout_shards_data_over_dp_only():
    """The torch backends' layout (``core.policy.registry``): data shards are ``dp`` (the fsdp
    ranks), context- and tensor-parallel ranks share a shard, axes in device-mesh order."""
    from core.policy.config import PolicyConfig
    from tests.torch_backends.conftest import policy_config

    def section(backend, **parallel):  # the layout reads no model file: any path will do
        cfg = policy_config(Path("unused-model"), backend)
        cfg["parallel"].update(parallel)
        return PolicyConfig.coerce(cfg, "policy")

    lay = device_layout(section("torch_dtensor", tensor_parallel_size=2, context_parallel_size=2), 8)
    assert lay.axis_names == ("dp", "cp", "tp") and lay.world_size == 8
    assert [lay.axis_size(a) for a in lay.axis_names] == [2, 2, 2]
    fsdp_only = device_layout(section("torch_fsdp"), 4)
    assert [fsdp_only.axis_size(a) for a in fsdp_only.axis_names] == [4, 1, 1]


# ---------------------------------------------------------------------- cluster
def test_master_address_and_port_is_bindable(ray_session):
    with RayVirtualCluster([1], use_gpus=False, name="probe") as cluster:
        assert cluster.world_size() == 1 and cluster.node_count() == 1
        assert cluster.bundle_resources() == {"CPU": 1}
        ip, port = cluster.get_master_address_and_port()
        ipaddress.ip_address(ip)  # raises if not an IP
        assert 0 < port < 65536
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, port))
    with pytest.raises(RuntimeError, match="already shut down"):
        cluster.get_placement_groups()


def test_unsatisfiable_placement_group_fails_fast_and_cleans_up(ray_session):
    ray = ray_session
    t0 = time.monotonic()
    with pytest.raises(ResourcesUnavailableError) as exc:
        RayVirtualCluster([64], use_gpus=False, placement_group_timeout_s=1.0, name="unsat")
    assert time.monotonic() - t0 < 10
    msg = str(exc.value)
    assert "[64] bundles per node" in msg and "{'CPU': 1}" in msg and "'CPU': 4.0" in msg
    with pytest.raises(ResourcesUnavailableError, match="'GPU': 1"):
        RayVirtualCluster([1], use_gpus=True, placement_group_timeout_s=0.5, name="unsat")
    # the groups that were not granted in time were removed, not left pending
    ours = [v for v in ray.util.placement_group_table().values() if v["name"] == "unsat-node0"]
    assert len(ours) == 2 and {v["state"] for v in ours} == {"REMOVED"}


def test_cluster_argument_validation(ray_session):
    for bad in ([], [2, 0], "4", [1.5]):
        with pytest.raises(ValueError, match="bundle_ct_per_node_list"):
            RayVirtualCluster(bad, use_gpus=False)


# ---------------------------------------------------------------------- one dp=2 x tp=2 group
class TestDpTpGroup:
    """Two logical nodes of 2 bundles, 4 workers, layout dp=2 x tp=2 (tp pairs share a node)."""

    @pytest.fixture(scope="class")
    def group(self, ray_session):
        cluster = RayVirtualCluster([2, 2], use_gpus=False, name="dptp")
        group = RayWorkerGroup(
            cluster,
            ProbeWorker,
            "grid",
            name_prefix="dptp",
            env_vars={"EXTRA_VAR": "x"},
            layout=WorkerLayout({"dp": 2, "tp": 2}),
        )
        yield group
        group.shutdown()
        cluster.shutdown()

    def test_env_vars_names_and_count(self, group, ray_session):
        ray = ray_session
        envs = group.get_all_worker_results(group.run_all_workers_single_data("env"))
        assert len(group.workers) == group.world_size == 4
        assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
        assert {e["WORLD_SIZE"] for e in envs} == {"4"}
        assert [e["NODE_RANK"] for e in envs] == ["0", "0", "1", "1"]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
        assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        assert envs[0]["MASTER_PORT"].isdigit()
        assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {""}
        assert {e["EXTRA_VAR"] for e in envs} == {"x"}
        for rank in range(4):
            actor = ray.get_actor(f"dptp-{rank}")
            assert ray.get(actor.rank.remote()) == rank

    def test_single_data(self, group):
        out = group.get_all_worker_results(group.run_all_workers_single_data("echo", 7, scale=3))
        assert out == [{"rank": r, "x": 7, "scale": 3, "tag": "grid"} for r in range(4)]

    def test_sharded_over_dp_replicated_over_tp(self, group, ray_session):
        fut = group.run_all_workers_sharded_data("echo", ["a", "b"], common_kwargs={"scale": 2})
        assert isinstance(fut, ShardedFuture)
        everyone = ray_session.get(fut.futures)
        assert [o["x"] for o in everyone] == ["a", "a", "b", "b"]  # dp shard per rank
        assert {o["scale"] for o in everyone} == {2}
        kept = group.get_all_worker_results(fut)
        assert [(o["rank"], o["x"]) for o in kept] == [(0, "a"), (2, "b")]  # tp-deduplicated

    def test_sharded_results_come_in_shard_order(self, group):
        # shard over the inner axis and keep every output: shard order is tp-major
        fut = group.run_all_workers_sharded_data(
            "echo",
            ["t0", "t1"],
            in_sharded_axes=("tp",),
            replicate_on_axes=("dp",),
            output_is_replicated=(),
        )
        kept = group.get_all_worker_results(fut)
        assert [(o["rank"], o["x"]) for o in kept] == [(0, "t0"), (2, "t0"), (1, "t1"), (3, "t1")]

    def test_sharded_over_two_axes_takes_nested_data(self, group):
        data = [["a0", "a1"], ["b0", "b1"]]
        fut = group.run_all_workers_sharded_data(
            "echo",
            data,
            in_sharded_axes=("dp", "tp"),
            replicate_on_axes=(),
            output_is_replicated=(),
        )
        assert [o["x"] for o in group.get_all_worker_results(fut)] == ["a0", "a1", "b0", "b1"]

    def test_sharded_data_errors(self, group):
        with pytest.raises(ValueError, match=r"len\(data\) is 3 but sharded axis 'dp' has size 2"):
            group.run_all_workers_sharded_data("echo", [1, 2, 3])
        nested_msg = r"len\(data\[1\]\) is 1 but sharded axis 'tp' has size 2"
        with pytest.raises(ValueError, match=nested_msg):
            group.run_all_workers_sharded_data(
                "echo", [[1, 2], [3]], in_sharded_axes=("dp", "tp"), replicate_on_axes=()
            )
        with pytest.raises(ValueError, match=r"axes \['tp'\] .* neither in in_sharded_axes"):
            group.run_all_workers_sharded_data("echo", [1, 2], replicate_on_axes=())
        with pytest.raises(ValueError, match="sharded axis 'cp' is not in"):
            group.run_all_workers_sharded_data("echo", [1], in_sharded_axes=("cp",))
        with pytest.raises(AttributeError, match="no method 'nope'"):
            group.run_all_workers_single_data("nope")

    def test_group_argument_validation(self, group):
        cluster = group._cluster
        with pytest.raises(ValueError, match=r"node 0 has 2 bundles x 1 worker\(s\) each; cannot place 3"):
            RayWorkerGroup(cluster, ProbeWorker, workers_per_node=3)
        with pytest.raises(ValueError, match="actors_per_bundle must be a positive int, got 0"):
            RayWorkerGroup(cluster, ProbeWorker, actors_per_bundle=0)
        with pytest.raises(ValueError, match=r"has 2 ranks but the group has 4 workers"):
            RayWorkerGroup(cluster, ProbeWorker, layout=WorkerLayout({"dp": 2}))
        with pytest.raises(ValueError, match=r"env_vars may not set \['RANK'\]"):
            RayWorkerGroup(cluster, ProbeWorker, env_vars={"RANK": "3"})


# ---------------------------------------------------------------------- placement details
def test_workers_per_node_subset_and_shutdown(make_group, ray_session):
    ray = ray_session
    group = make_group([2, 2], workers_per_node=[1, 2], name_prefix="subset")
    envs = group.get_all_worker_results(group.run_all_workers_single_data("env"))
    assert [(e["RANK"], e["NODE_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "0", "1"),
        ("1", "1", "0", "2"),
        ("2", "1", "1", "2"),
    ]
    workers = group.workers
    assert group.shutdown(cleanup_method="cleanup", timeout=20) is True
    assert group.shutdown() is True  # idempotent
    assert group.workers == []
    for w in workers:
        _assert_dead(ray, w)


def test_several_actors_share_a_bundle(make_group):
    """``actors_per_bundle``: consecutive ranks in one bundle, each with its share of it (the
    CPU engines of a multi-CPU bundle, core.generation.vllm_generation)."""
    group = make_group([2], actors_per_bundle=2, name_prefix="shared")
    envs = group.get_all_worker_results(group.run_all_workers_single_data("env"))
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "4"),
        ("1", "1", "4"),
        ("2", "2", "4"),
        ("3", "3", "4"),
    ]
    assert group._placement == [(0, 0), (0, 0), (0, 1), (0, 1)]  # (node, bundle) of each rank
    with pytest.raises(ValueError, match=r"node 0 has 2 bundles x 2 worker\(s\) each; cannot place 5"):
        RayWorkerGroup(group._cluster, ProbeWorker, workers_per_node=5, actors_per_bundle=2)


def test_cpu_actor_threads_are_its_share_of_the_bundle(ray_session, monkeypatch):
    """On CPU an actor computes with its bundle's CPUs divided among the actors placed in it,
    not among the groups colocated on it (Ray alone: floor of its num_cpus, 4 x 1/2 / 2 = 1
    here); a user's OMP_NUM_THREADS wins."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=4, max_colocated_worker_groups=2) as cluster:
        for per_bundle, threads in ((1, "4"), (2, "2")):
            group = RayWorkerGroup(cluster, ProbeWorker, actors_per_bundle=per_bundle, name_prefix=f"t{per_bundle}")
            try:
                envs = group.get_all_worker_results(group.run_all_workers_single_data("env"))
            finally:
                group.shutdown()
            assert [e["OMP_NUM_THREADS"] for e in envs] == [threads] * per_bundle
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        group = RayWorkerGroup(cluster, ProbeWorker, name_prefix="threads_user")
        try:
            assert group.get_all_worker_results(group.run_all_workers_single_data("env"))[0]["OMP_NUM_THREADS"] == "3"
        finally:
            group.shutdown()


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (the bracketed word), None where it has none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def _started_with(name: str) -> bool:
    """Whether this process was started with env var ``name`` (monkeypatch cannot unset it for
    glibc, which read it at start-up)."""
    return any(entry.startswith(name.encode() + b"=") for entry in Path("/proc/self/environ").read_bytes().split(b"\0"))


def test_cpu_actor_malloc_keeps_large_blocks_in_huge_pages(ray_session, monkeypatch):
    """A CPU actor starts with CPU_MALLOC_TUNABLES: a 64 MiB block (XLA:CPU's temporary buffer
    is such a block, per execution) is faulted in as huge pages where the kernel allows them on
    request, and once freed it is kept: the next one of its size faults nothing in.  The driver's
    own process, without the tunables, maps every such block afresh (in 4 KiB pages where THP is
    only on request) and faults it in again.  A user's GLIBC_TUNABLES wins."""
    nbytes = 64 << 20
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1) as cluster:
        group = RayWorkerGroup(cluster, ProbeWorker, name_prefix="malloc")
        try:
            assert (
                group.get_all_worker_results(group.run_all_workers_single_data("env"))[0]["GLIBC_TUNABLES"]
                == CPU_MALLOC_TUNABLES
            )
            if _thp_mode() in ("madvise", "always"):
                gained = group.get_all_worker_results(
                    group.run_all_workers_single_data("huge_pages_of_a_malloc", nbytes)
                )
                assert gained[0] >= 32 * 1024, f"{gained[0]} KiB of huge pages for a 64 MiB malloc"
            refaults = group.get_all_worker_results(
                group.run_all_workers_single_data("faults_of_a_second_malloc", nbytes)
            )
            # kept: no page faults in; mapped afresh it would be 32 (huge pages) or 16,384 (4 KiB)
            assert refaults[0] < 8, f"{refaults[0]} page faults for a 64 MiB block freed and allocated again"
        finally:
            group.shutdown()
        if not _started_with("GLIBC_TUNABLES"):
            if _thp_mode() == "madvise":
                assert ProbeWorker().huge_pages_of_a_malloc(nbytes) == 0
            assert ProbeWorker().faults_of_a_second_malloc(nbytes) >= 16  # 32 in huge pages
        monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
        group = RayWorkerGroup(cluster, ProbeWorker, name_prefix="malloc_user")
        try:
            envs = group.get_all_worker_results(group.run_all_workers_single_data("env"))
            assert envs[0]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
        finally:
            group.shutdown()


def test_gloo_all_reduce_through_env(make_group):
    group = make_group([2], GlooWorker, name_prefix="gloo")
    out = group.get_all_worker_results(group.run_all_workers_single_data("all_reduce"), timeout=120)
    assert out == [3.0, 3.0]


# ---------------------------------------------------------------------- failures
def test_dead_worker_fails_fast_and_kills_group(make_group, ray_session):
    group = make_group([2], name_prefix="die")
    assert group.get_all_worker_results(group.run_all_workers_single_data("rank")) == [0, 1]
    futures = group.run_all_workers_single_data("die_on", 1)
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError) as exc:
        group.get_all_worker_results(futures)
    assert time.monotonic() - t0 < 15
    err = exc.value
    assert err.ranks == [1] and err.method == "die_on"
    assert "'die_on' failed on rank(s) [1]" in str(err) and "Actor" in str(err)
    _assert_dead(ray_session, group.workers[0])  # the rank stuck in sleep(60) was killed
    with pytest.raises(WorkerGroupError, match="actors were killed"):
        group.run_all_workers_single_data("rank")
    assert group.shutdown(cleanup_method="cleanup") is False  # cleanup can no longer run


def test_worker_exception_names_rank_and_message(make_group, ray_session):
    group = make_group([2], name_prefix="raise")
    fut = group.run_all_workers_sharded_data("raise_on", [1, 1])  # both ranks get rank=1
    with pytest.raises(WorkerGroupError) as exc:
        group.get_all_worker_results(fut)
    err = exc.value
    assert err.ranks == [1] and err.method == "raise_on"
    assert "rank 1: ValueError: boom from rank 1" in str(err)
    assert isinstance(err.errors[1], ray_session.exceptions.RayTaskError)
    _assert_dead(ray_session, group.workers[0])


def test_failure_before_any_collective_keeps_the_group(make_group, ray_session):
    group = make_group([2], name_prefix="recover")
    with pytest.raises(RecoverableCallError) as exc:
        group.get_all_worker_results(group.run_all_workers_single_data("reject_on", 0, 0.5))
    err = exc.value
    assert err.recoverable and err.ranks == [0] and err.method == "reject_on"
    assert "KeyError: 'bad key on rank 0'" in str(err) and "alive and usable" in str(err)
    # the same actors answer the next call
    assert group.get_all_worker_results(group.run_all_workers_single_data("rank")) == [0, 1]


def test_recoverable_failure_with_a_stranded_peer_is_fatal(make_group, ray_session):
    group = make_group([2], name_prefix="strand")
    group.recover_grace_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError) as exc:  # rank 1 "waits in a collective" for 60 s
        group.get_all_worker_results(group.run_all_workers_single_data("reject_on", 0, 60))
    assert time.monotonic() - t0 < 15
    assert not exc.value.recoverable and "rank(s) [1] had not finished" in str(exc.value)
    assert "Fatal" in str(exc.value)
    _assert_dead(ray_session, group.workers[1])


def test_timeout_names_unfinished_ranks(make_group):
    group = make_group([2], name_prefix="slow")
    t0 = time.monotonic()
    msg = r"'sleep' did not finish within 1.0 s on rank\(s\) \[0, 1\]"
    with pytest.raises(WorkerGroupError, match=msg) as exc:
        group.get_all_worker_results(group.run_all_workers_single_data("sleep", 30), timeout=1.0)
    assert time.monotonic() - t0 < 10
    assert exc.value.ranks == [0, 1]
