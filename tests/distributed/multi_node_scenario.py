"""A Policy whose workers span two Ray nodes, against the same Policy on one node.

``python -m tests.distributed.multi_node_scenario BACKEND --out result.json`` (run by
``tests/distributed/test_multi_node.py`` in a subprocess, under a deadline).  It starts its
own ``ray.cluster_utils.Cluster`` -- a head raylet and a worker raylet on this machine: two
Ray nodes with their own node ids, object stores and worker pools -- in a private Ray temp
dir, so it neither disturbs nor is disturbed by the pytest session's Ray or another
session's on the same machine.  The driver joins it through ``init_ray(address=...)``, as a
job on a real cluster does.

Two runs on the same tiny model, batch and seed:

* ``multi``: ``RayVirtualCluster([1, 1], num_cpus_per_bundle=NODE_CPUS)``.  A bundle takes
  all of a node's CPUs, so Ray must put the two logical nodes on the two raylets (it has no
  anti-affinity between placement groups; sizing is what forces the spread).  Torch: dp=2,
  one rank per node, gloo across them.  JAX: two processes joined by ``jax.distributed``
  (coordinator = the group's MASTER_ADDR:PORT), ``DEVICES_PER_PROCESS`` XLA host devices each.
* ``single``: one node.  Torch: the same dp=2 in two 1-CPU bundles of one raylet, so only
  the placement differs.  JAX: one process owning ``DEVICES_PER_PROCESS`` devices.

Each run reports the Ray node id each worker actually runs on (the GCS actor table, not
where its bundle was meant to go), ``get_logprobs`` of a batch, one ClippedPG train step's
loss, grad norm and the sum of its per-micro-batch losses over the workers, and
``get_logprobs`` after that step.  The result is one JSON file; the
test compares, so a failure shows the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

#: Logical CPUs of each raylet.  A multi-node bundle asks for all of them, so the two logical
#: nodes cannot share a raylet; the torch one-node run packs two 1-CPU bundles into one.
NODE_CPUS = 2
#: XLA host devices per JAX process: a host has several local devices and a remote peer.
DEVICES_PER_PROCESS = 2
BACKENDS = ("torch_fsdp", "torch_dtensor", "jax_pjit")
#: How long RayVirtualCluster waits for its placement groups (the test's subprocess deadline
#: covers a hang anywhere else).
PLACEMENT_TIMEOUT_S = 60.0


def _set_process_env(backend: str, ray_tmp: str) -> None:
    """Env read by Ray, torch and XLA when they start; the raylets and their workers inherit it.

    One OpenMP thread everywhere: Ray would otherwise give each actor as many threads as its
    bundle has CPUs (2 across nodes, 1 on one node), and the runs must do the same arithmetic.
    ``RAY_TMPDIR``: the Cluster writes its address to ``$RAY_TMPDIR/ray/ray_current_cluster``,
    which a plain ``ray.init()`` anywhere on the machine would otherwise pick up and join.
    """
    os.environ.update(
        RAY_TMPDIR=ray_tmp,
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        JAX_PLATFORMS="cpu",
    )
    os.environ.pop("RAY_ADDRESS", None)  # never join some other cluster
    if backend == "jax_pjit":
        from core.distributed.ray_init import jax_cpu_flags

        os.environ["XLA_FLAGS"] = jax_cpu_flags("", DEVICES_PER_PROCESS)


def start_cluster():
    """Head + one worker raylet, NODE_CPUS CPUs each; the driver connected to it."""
    from ray.cluster_utils import Cluster

    from core.distributed import init_ray

    node_args = dict(num_cpus=NODE_CPUS, object_store_memory=96 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **node_args))
    try:
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        init_ray(address=cluster.address)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def alive_node_ids() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def worker_node_ids(policy) -> list[str]:
    """Ray node id of each rank's actor, as the GCS records where the actor runs.

    A private helper of Ray: the public state API (``ray.util.state``) needs the dashboard,
    which the cluster runs without."""
    import ray

    ids = []
    for actor in policy.worker_group.workers:
        info = ray._private.state.actors(actor_id=actor._actor_id.hex())
        ids.append(info["Address"]["NodeID"])
    return ids


def policy_config(model_dir: Path, backend: str) -> dict:
    """The backend tests' config (batch 4, micro batch 2, AdamW lr 1e-2) on ``model_dir``;
    JAX: the mesh is all of a process's devices on ``fsdp``, whatever their count."""
    from tests.torch_backends.conftest import policy_config as base

    cfg = base(model_dir, backend)
    if backend == "jax_pjit":
        cfg["parallel"].update(fsdp_size=-1, tensor_parallel_size=1)
    return cfg


def measure(bundles: list[int], num_cpus_per_bundle: int, backend: str, model_dir: Path, tokenizer, name: str) -> dict:
    """Start a Policy on ``bundles``, run logprobs / one train step / logprobs, shut it down."""
    import torch

    from core.distributed import RayVirtualCluster
    from core.losses import ClippedPGLossFn
    from core.policy import Policy
    from tests.torch_backends.conftest import pg_batch
    from tests.unit.test_losses import BASE_CFG

    start = time.monotonic()
    cluster = RayVirtualCluster(
        bundles,
        use_gpus=False,
        num_cpus_per_bundle=num_cpus_per_bundle,
        name=name,
        placement_group_timeout_s=PLACEMENT_TIMEOUT_S,
    )
    try:
        policy = Policy(cluster, policy_config(model_dir, backend), tokenizer, name_prefix=name)
        try:
            batch = pg_batch(4, seed=3)
            logprobs = policy.get_logprobs(batch)["logprobs"]
            result = policy.train(batch, ClippedPGLossFn(BASE_CFG))
            after = policy.get_logprobs(batch)["logprobs"]
            return {
                "worker_node_ids": worker_node_ids(policy),
                "logprobs": logprobs.to(torch.float64).tolist(),
                "loss": float(result.loss[0]),
                "grad_norm": float(result.grad_norm[0]),
                "micro_batch_loss_sum": float(sum(result.all_mb_metrics["loss"])),
                "logprobs_after_step": after.to(torch.float64).tolist(),
                "seconds": time.monotonic() - start,
            }
        finally:
            policy.shutdown()
    finally:
        cluster.shutdown()


def run_scenario(backend: str) -> dict:
    import ray

    from core.testing.tiny_models import save_tiny_model, tiny_tokenizer

    start = time.monotonic()
    cluster = start_cluster()
    try:
        cluster_seconds = time.monotonic() - start
        with tempfile.TemporaryDirectory(prefix="multi_node_model_") as tmp:
            model_dir = save_tiny_model("llama", Path(tmp) / "llama")
            tokenizer = tiny_tokenizer()
            multi = measure([1, 1], NODE_CPUS, backend, model_dir, tokenizer, "multi")
            if backend == "jax_pjit":  # one process: the same devices-per-process, on one node
                single = measure([1], NODE_CPUS, backend, model_dir, tokenizer, "single")
            else:  # the same dp=2, both ranks on one node
                single = measure([2], 1, backend, model_dir, tokenizer, "single")
        return {
            "backend": backend,
            "cluster_node_ids": alive_node_ids(),
            "multi": multi,
            "single": single,
            "cluster_start_seconds": cluster_seconds,
            "total_seconds": time.monotonic() - start,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def _exit_on_sigterm(signum, frame) -> None:
    # SystemExit unwinds through the finally blocks, which shut the raylets down.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=BACKENDS)
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument(
        "--ray-tmp",
        help="Ray's temp dir (RAY_TMPDIR), left to the caller to "
        "remove; default: a fresh one under /tmp, removed at exit",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ray_tmp = args.ray_tmp or make_ray_tmp()
    try:
        _set_process_env(args.backend, ray_tmp)
        result = run_scenario(args.backend)
        Path(args.out).write_text(json.dumps(result))
    finally:
        if not args.ray_tmp:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    return 0


def make_ray_tmp() -> str:
    """A fresh, short directory for RAY_TMPDIR: Ray puts unix sockets under it, and their
    paths must stay under 108 bytes, so /tmp rather than a deep pytest tmp_path."""
    return tempfile.mkdtemp(prefix="dualrl-mn-", dir="/tmp" if os.path.isdir("/tmp") else None)


if __name__ == "__main__":
    sys.exit(main())
