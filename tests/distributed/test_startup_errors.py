"""Start-up errors carry their cause (issue 15, item 6).

A worker that dies in its constructor reaches the driver as a ``WorkerStartupError`` whose
first line names the rank, the exception the constructor raised (type and message) and the
project line that raised it -- not only Ray's "the actor died because of an error raised in
its creation task".  A local model path that does not exist is refused on the driver,
naming the field and the path, before any worker starts.

The Policy cases start real workers (~10-15 s each on 2 cores); each must fail within
``DEADLINE_S``.
"""

from __future__ import annotations

import re
import shutil
import time
from types import SimpleNamespace

import pytest

from core.distributed import RayVirtualCluster, RayWorkerGroup, WorkerGroupError, WorkerStartupError
from core.distributed.startup_failure import startup_failure
from tests.torch_backends.conftest import policy_config

DEADLINE_S = 60.0
THIS_FILE = "tests/distributed/test_startup_errors.py"


# ---------------------------------------------------------------------- test workers
class FailingWorker:
    """Raises in its constructor on ``fail_rank`` (all ranks if None)."""

    def __init__(self, fail_rank: int | None = None, chained: bool = False) -> None:
        import os

        rank = int(os.environ["RANK"])
        if fail_rank is None or rank == fail_rank:
            if chained:
                try:
                    {}["missing_key"]
                except KeyError as err:
                    raise ValueError(f"bad setting on rank {rank}\nsecond line") from err
            raise ValueError(f"bad setting on rank {rank}\nsecond line")

    def is_alive(self) -> bool:
        return True

    def echo(self, x):
        return x


class _Unpicklable(Exception):
    def __init__(self, message: str, handle) -> None:
        super().__init__(message)
        self.handle = handle

    def __reduce__(self):
        raise TypeError("cannot pickle this exception")


class UnpicklableErrorWorker:
    def __init__(self) -> None:
        raise _Unpicklable("the real cause", handle=object())

    def is_alive(self) -> bool:
        return True


def _line_of(text: str) -> int:
    """The line of this file that contains ``text`` (for the expected location)."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if text in line and "_line_of" not in line:
                return i
    raise AssertionError(text)


@pytest.fixture
def cluster2(ray_session):
    cluster = RayVirtualCluster([2], use_gpus=False)
    yield cluster
    cluster.shutdown()


# ---------------------------------------------------------------------- RayWorkerGroup
def test_constructor_error_names_rank_bundle_cause_and_line(cluster2):
    start = time.monotonic()
    group = RayWorkerGroup(cluster2, FailingWorker, 1, name_prefix="startup_fail")
    with pytest.raises(WorkerStartupError) as info:
        group.get_all_worker_results(group.run_all_workers_single_data("is_alive"), timeout=DEADLINE_S)
    assert time.monotonic() - start < DEADLINE_S
    err = info.value
    first_line = str(err).splitlines()[0]
    line = _line_of('raise ValueError(f"bad setting on rank {rank}\\nsecond line")\n')
    assert first_line.startswith(
        "RayWorkerGroup('startup_fail'): rank 1 (node 0, bundle 1) failed to start: "
        "ValueError: bad setting on rank 1 (at "
    ), first_line
    assert f"{THIS_FILE}:{line} in __init__" in first_line
    assert "second line" not in first_line  # first line of the message only
    assert "rank 1 (node 0, bundle 1, ip " in str(err)
    assert "FailingWorker.__init__" in str(err) and "remote traceback" in str(err)
    assert isinstance(err, WorkerGroupError) and isinstance(err, RuntimeError)
    assert err.ranks == [1] and err.method == "is_alive"
    failure = err.failures[1]
    assert failure.exc_type == "ValueError" and failure.first_line == "bad setting on rank 1"
    assert failure.location == f"{THIS_FILE}:{line} in __init__"
    assert startup_failure(err) == failure  # also found through the exception chain
    # the group is dead: later calls say so without touching Ray
    with pytest.raises(WorkerGroupError, match="failed to start"):
        group.run_all_workers_single_data("echo", 1)
    group.shutdown()


def test_constructor_error_on_first_real_call_and_chained_cause(cluster2):
    """Not only ``is_alive``: any call on the dead group gives the constructor's error, and
    the chain's original exception is named."""
    group = RayWorkerGroup(cluster2, FailingWorker, None, chained=True, name_prefix="startup_chain")
    with pytest.raises(WorkerStartupError) as info:
        group.get_all_worker_results(group.run_all_workers_single_data("echo", 3), timeout=DEADLINE_S)
    msg = str(info.value)
    assert re.match(
        r"RayWorkerGroup\('startup_chain'\): rank [01].* failed to start: ValueError: bad setting on "
        r"rank [01] \(at tests/distributed/test_startup_errors\.py:\d+ in __init__\)",
        msg,
    ), msg
    assert "caused by KeyError: 'missing_key'" in msg
    group.shutdown()


def test_unpicklable_constructor_error_is_read_off_the_traceback(ray_session):
    cluster = RayVirtualCluster([1], use_gpus=False)
    try:
        group = RayWorkerGroup(cluster, UnpicklableErrorWorker, name_prefix="startup_unpicklable")
        with pytest.raises(WorkerStartupError) as info:
            group.get_all_worker_results(group.run_all_workers_single_data("is_alive"), timeout=DEADLINE_S)
        first_line = str(info.value).splitlines()[0]
        assert "rank 0 (node 0, bundle 0) failed to start" in first_line and "the real cause" in first_line, str(
            info.value
        )
        assert f"{THIS_FILE}:" in first_line
        group.shutdown()
    finally:
        cluster.shutdown()


# ---------------------------------------------------------------------- Policy start-up
def _start_policy(cfg, tokenizer, name_prefix: str, bundles=(1,), **cluster_kwargs) -> WorkerStartupError:
    """Start a Policy that must fail in a worker's constructor; return the error.  One worker
    (rank 0): the multi-rank naming is the RayWorkerGroup tests' job, and a worker start costs
    seconds on 2 cores."""
    from core.policy import Policy

    cluster = RayVirtualCluster(list(bundles), use_gpus=False, **cluster_kwargs)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerStartupError) as info:
            Policy(cluster, cfg, tokenizer, name_prefix=name_prefix)
    finally:
        cluster.shutdown()
    assert time.monotonic() - start < DEADLINE_S
    print(str(info.value)[:1500])
    return info.value


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0]


def test_policy_optimizer_that_cannot_be_imported(ray_session, model_dirs, tokenizer):
    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    cfg["optimizer"]["name"] = "torch.optim.NoSuchOptimizer"
    err = _start_policy(cfg, tokenizer, "bad_opt_name")
    line = _first_line(err)
    assert re.search(
        r"rank 0 \(node 0, bundle 0\) failed to start: ValueError: policy\.optimizer\.name: cannot import "
        r"'torch\.optim\.NoSuchOptimizer'",
        line,
    ), line
    assert "(at backends/torch_common/optim.py:" in line


# slow (~5 s each): the optimizer import case above keeps the start-up failure path fast
@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"lr": "abc"}, r"ValueError: policy\.optimizer\.kwargs .* rejected by torch\.optim\.AdamW"),
        (
            {"no_such_kwarg": 1},
            r"ValueError: policy\.optimizer\.kwargs .* rejected by torch\.optim\.AdamW: .*no_such_kwarg",
        ),
    ],
)
def test_policy_bad_optimizer_kwargs(kwargs, expected, ray_session, model_dirs, tokenizer):
    cfg = policy_config(model_dirs["llama"], "torch_dtensor")
    cfg["optimizer"]["kwargs"].update(kwargs)
    line = _first_line(_start_policy(cfg, tokenizer, "bad_opt_kwargs"))
    assert re.search(r"rank 0 \(node 0, bundle 0\) failed to start: " + expected, line), line
    assert "(at backends/torch_common/optim.py:" in line


# slow (~5 s: a worker starts to fail): the same start-up failure path as the optimizer import above
@pytest.mark.slow
def test_policy_unknown_scheduler(ray_session, model_dirs, tokenizer):
    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    cfg["scheduler"] = [{"name": "torch.optim.lr_scheduler.NoSuchLR", "kwargs": {}}]
    line = _first_line(_start_policy(cfg, tokenizer, "bad_sched"))
    assert re.search(
        r"rank 0 \(node 0, bundle 0\) failed to start: ValueError: policy\.scheduler\[0\]\.name: cannot import "
        r"'torch\.optim\.lr_scheduler\.NoSuchLR'",
        line,
    ), line


def test_policy_truncated_safetensors(ray_session, model_dirs, tokenizer, tmp_path):
    model_dir = tmp_path / "truncated"
    shutil.copytree(model_dirs["llama"], model_dir)
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    cfg = policy_config(model_dir, "torch_fsdp")
    err = _start_policy(cfg, tokenizer, "truncated")
    line = _first_line(err)
    failure = err.failures[err.ranks[0]]
    assert re.search(r"rank 0 \(node 0, bundle 0\) failed to start: \w+(Error|Exception)?: ", line), line
    assert failure.message and failure.location, failure
    assert failure.first_line in line and failure.exc_type in line


# slow (~5 s: a worker starts to fail): the same start-up failure path as the optimizer import above
@pytest.mark.slow
def test_policy_model_dir_without_weights(ray_session, model_dirs, tokenizer, tmp_path):
    model_dir = tmp_path / "no_weights"
    shutil.copytree(model_dirs["llama"], model_dir)
    (model_dir / "model.safetensors").unlink()
    cfg = policy_config(model_dir, "torch_fsdp")
    err = _start_policy(cfg, tokenizer, "no_weights")
    line = _first_line(err)
    failure = err.failures[err.ranks[0]]
    assert re.search(r"rank 0 \(node 0, bundle 0\) failed to start: \w+: ", line), line
    assert str(model_dir) in failure.message or "model.safetensors" in failure.message, failure
    assert failure.location.startswith(("backends/", "core/")), failure


def test_policy_jax_mesh_that_does_not_match_the_devices_is_refused_on_the_driver(
    ray_session, model_dirs, tokenizer, monkeypatch
):
    import core.policy.policy as policy_module
    from core.config import ConfigError
    from core.policy import Policy

    monkeypatch.setattr(policy_module, "RayWorkerGroup", _NoWorkers)
    cfg = policy_config(model_dirs["llama"], "jax_pjit")
    cfg["parallel"].update(fsdp_size=3, tensor_parallel_size=2)  # 6 of the host's 8 devices
    with RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2, name="bad_mesh_driver") as cluster:
        with pytest.raises(ConfigError) as err:
            Policy(cluster, cfg, tokenizer, name_prefix="bad_mesh_driver")
    assert str(err.value).startswith(
        "policy.parallel.fsdp_size: fsdp_size (3) x tensor_parallel_size (2) = 6 does not equal the world size (8)"
    )
    assert str(err.value).endswith("(1 worker(s) x 8 device(s) each)")


def test_policy_jax_weight_that_cannot_be_placed_is_refused_on_the_driver(
    ray_session, model_dirs, tokenizer, monkeypatch, tmp_path
):
    """A tensor-parallel size that does not divide the experts' width (which the torch-side
    check of heads and MLP widths does not see): refused from config.json alone."""
    import json

    import core.policy.policy as policy_module
    from core.config import ConfigError
    from core.policy import Policy

    monkeypatch.setattr(policy_module, "RayWorkerGroup", _NoWorkers)
    model_dir = tmp_path / "moe_33"
    shutil.copytree(model_dirs["qwen3_moe"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": 33}))
    cfg = policy_config(model_dir, "jax_pjit")
    cfg["parallel"].update(fsdp_size=-1, tensor_parallel_size=2)
    with RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2, name="bad_placement_driver") as cluster:
        with pytest.raises(ConfigError) as err:
            Policy(cluster, cfg, tokenizer, name_prefix="bad_placement_driver")
    lines = str(err.value).splitlines()
    assert len(lines) == 3 and all(
        line.startswith("policy.parallel.tensor_parallel_size: layers/1/mlp/experts/") for line in lines
    )
    assert "('mlp') has size 33, not divisible by mesh axis tp (2)" in lines[0]


# ---------------------------------------------------------------------- model paths (driver side)
class _NoWorkers:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a worker group was started for a model path that does not exist")


@pytest.mark.parametrize(
    "name", ["/no/such/model_dir", "./no_such_model", "../no_such_model", "~/no_such_model_dir", "a/b/no_such_model"]
)
def test_missing_local_model_path_fails_on_the_driver(name, model_dirs, tokenizer, monkeypatch, tmp_path):
    import core.policy.policy as policy_module
    from core.policy import Policy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(policy_module, "RayWorkerGroup", _NoWorkers)
    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    cfg["model_name"] = name
    cluster = SimpleNamespace(bundle_ct_per_node_list=[2])
    with pytest.raises(FileNotFoundError, match=f"^policy.model_name: no such directory: {re.escape(name)}$"):
        Policy(cluster, cfg, tokenizer)


def test_missing_path_under_an_existing_directory_is_local(model_dirs, tokenizer, monkeypatch, tmp_path):
    """``models/run-3`` next to an existing ``models`` directory is a path, not a hub id."""
    from core.policy.preflight import check_model_path, looks_like_local_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert looks_like_local_path("models/run-3")
    with pytest.raises(FileNotFoundError, match="^policy.model_name: no such directory: models/run-3$"):
        check_model_path("models/run-3", "policy.model_name")
    (tmp_path / "models" / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="policy.model_name: not a directory: models/file"):
        check_model_path("models/file", "policy.model_name")
    check_model_path(str(model_dirs["llama"]), "policy.model_name")  # exists: fine


@pytest.mark.parametrize("name", ["gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "org/name", "builtin:arithmetic-llama"])
def test_hub_ids_and_builtins_are_not_paths(name, monkeypatch, tmp_path):
    from core.policy.preflight import check_model_path, looks_like_local_path

    monkeypatch.chdir(tmp_path)
    if not name.startswith("builtin:"):
        assert not looks_like_local_path(name)
    check_model_path(name, "policy.model_name")  # no error: left to transformers / the hub


def _policy_section(model_dirs, **changes):
    """A valid ``policy`` section (``PolicyConfig``) with top-level ``changes`` applied."""
    from core.policy.config import PolicyConfig

    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    cfg.update(changes)
    return PolicyConfig.coerce(cfg, "policy")


def test_hub_id_still_reaches_autoconfig(model_dirs, tokenizer, monkeypatch, tmp_path):
    """A hub id goes through the same code path as before (AutoConfig), offline here."""
    import transformers

    from core.policy.preflight import preflight_model_checks

    policy = _policy_section(model_dirs, model_name="org/name")

    monkeypatch.chdir(tmp_path)
    seen = []

    def fake_from_pretrained(name, *args, **kwargs):
        seen.append(name)
        raise OSError("offline")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake_from_pretrained)
    with pytest.raises(ValueError, match="policy.model_name='org/name': cannot read its HF config: offline"):
        preflight_model_checks(policy, tokenizer)
    assert seen == ["org/name"]


def test_missing_tokenizer_and_model_paths_in_run_setup(model_dirs, monkeypatch, tmp_path):
    from core.algorithms.config import ClusterConfig, MasterConfig
    from core.algorithms.run_setup import load_tokenizer
    from core.algorithms.warm_start import resolve_model

    monkeypatch.chdir(tmp_path)
    no_tokenizer = _policy_section(model_dirs, tokenizer={"name": "./no_tokenizer"})
    with pytest.raises(FileNotFoundError, match="^policy.tokenizer.name: no such directory: ./no_tokenizer$"):
        load_tokenizer(no_tokenizer)
    run = MasterConfig(
        policy=_policy_section(model_dirs, model_name="/no/such/model"), cluster=ClusterConfig(gpus_per_node=1)
    )
    with pytest.raises(FileNotFoundError, match="^policy.model_name: no such directory: /no/such/model$"):
        resolve_model(run, exclude_prompts=[])


# ---------------------------------------------------------------------- vLLM engine actor
def test_vllm_missing_model_path_fails_on_the_driver(model_dirs, tokenizer, monkeypatch, tmp_path):
    import core.generation.vllm_generation as vllm_generation

    monkeypatch.setattr(vllm_generation, "RayWorkerGroup", _NoWorkers)
    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    cfg["generation"]["vllm_cfg"].update(max_model_len=64)
    cfg["model_name"] = str(tmp_path / "gone")
    cluster = SimpleNamespace(bundle_ct_per_node_list=[1])
    with pytest.raises(
        FileNotFoundError, match=f"^policy.model_name: no such directory: {re.escape(cfg['model_name'])}$"
    ):
        vllm_generation.VllmGeneration(cluster, cfg, tokenizer)


# slow (9 s: a vLLM import in a fresh actor): the same path -- an exception Ray cannot pickle,
# read off the traceback -- stays fast in test_unpicklable_constructor_error_is_read_off_the_traceback.
@pytest.mark.slow
def test_vllm_engine_constructor_error_names_rank_and_cause(ray_session, tokenizer, tmp_path):
    """``max_model_len`` beyond the model's 512 positions: vLLM refuses it in the engine
    actor's constructor (an exception Ray cannot pickle; its text is read off the traceback)."""
    from core.generation import VllmGeneration
    from core.testing.tiny_models import save_tiny_model

    model_dir = save_tiny_model("llama_gen", tmp_path / "llama_gen")
    cfg = policy_config(model_dir, "torch_fsdp")
    cfg["generation"]["vllm_cfg"].update(max_model_len=100_000)
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerStartupError) as info:
            VllmGeneration(cluster, cfg, tokenizer, name_prefix="vllm_bad_len")
    finally:
        cluster.shutdown()
    assert time.monotonic() - start < 120
    line = _first_line(info.value)
    print(str(info.value)[:1500])
    assert line.startswith("RayWorkerGroup('vllm_bad_len'): rank 0 (node 0, bundle 0) failed to start: "), line
    assert "ValidationError: 1 validation error for ModelConfig: " in line and "max_model_len" in line, line
    assert "(at core/generation/vllm_worker.py:" in line, line
    assert info.value.failures[0].exc_type == "ValidationError"
