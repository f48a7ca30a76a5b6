"""The backend contract suite: what every backend must do, written once, run on every layout.

``LAYOUTS`` names the layouts in the ``benchmarks.lib.layouts`` grammar (test ids are these names);
:func:`layout_config` turns one into a policy config (the one place that does), on top of
``tests/torch_backends/conftest.py: policy_config``.  A behaviour a backend does not have is
a parametrised case asserting the refusal by name, never a missing row.

Cost: one policy per layout, not one per test.  The ``policies`` pool keeps one policy alive at
a time; :func:`pytest_collection_modifyitems` orders this package's tests by layout, so each
layout's policy starts once (the padded-vocabulary one once more).  A test that starts a second
policy asks the pool to make room first (``PolicyPool.make_room``: the session's Ray has 4
CPUs; a 2-worker layout leaves room, the 4-worker one does not).  Each pooled
policy saves its initial state (weights, optimizer, LR schedule, step) right after it starts;
``fresh_policy`` restores that state when an earlier test trained, so a test that needs the
initial weights never depends on which tests ran before it.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lib.layouts import Layout, apply_settings, parse_layout
from core.interfaces import LossType
from core.losses import NLLLoss
from core.policy.worker_protocol import PolicyWorker
from core.testing.tiny_models import random_batch
from tests.plugin_backend.site import PLUGIN_SESSION_ENV
from tests.torch_backends.conftest import SEQ, VOCAB, policy_config

#: Every layout the contract suite runs (``benchmarks.lib.layouts`` grammar).  A JAX worker owns all
#: of its host's devices, and the test session gives it 8 (tests/conftest.py: XLA_FLAGS), so the
#: JAX meshes are 8 devices.
LAYOUTS = [
    "fsdp1-dp2",
    "dtensor-dp2",
    "dtensor-tp2",
    "dtensor-tp2-sp",
    "dtensor-dp2-tp2-sp",
    "jax-fsdp8",
    "jax-fsdp4-tp2",
]
# The plug-in backend's row (tests/plugin_backend): in a session started with the plug-in installed
# (its dist-info on PYTHONPATH, so the Ray workers see it too), which
# tests/plugin_backend/test_plugin_backend.py runs in a subprocess; other sessions list the built-ins.
if os.environ.get(PLUGIN_SESSION_ENV):
    LAYOUTS.append("eager-dp1")
#: Layouts behind ``@pytest.mark.slow`` (``make test-all``).  The fast run keeps one layout per
#: engine: FSDP1; FSDP2 sharding composed with tensor and sequence parallel (4 workers); a
#: sharded JAX mesh with tensor parallel.  The slow ones take each apart, and run the plug-in backend
#: (tests/plugin_backend; its fast proof is tests/plugin_backend/test_plugin_backend.py).
SLOW_LAYOUTS = {"dtensor-dp2", "dtensor-tp2", "dtensor-tp2-sp", "jax-fsdp8", "eager-dp1"}
#: The tiny model each layout's policy runs: Llama, Qwen2 (q/k/v bias) and tied embeddings spread
#: over the layouts, so the fast ones cover every family (the padded-vocabulary policies run a
#: tied Qwen2 on the fast torch and JAX layouts).
MODEL_OF = {
    "fsdp1-dp2": "llama",
    "dtensor-dp2": "llama_tied",
    "dtensor-tp2": "llama",
    "dtensor-tp2-sp": "qwen2",
    "dtensor-dp2-tp2-sp": "qwen2",
    "jax-fsdp8": "qwen2",
    "jax-fsdp4-tp2": "llama_tied",
    "eager-dp1": "llama",
}
#: Logical CPUs of the test session's Ray (tests/conftest.py ``ray_session``): a torch worker
#: takes 1, the JAX worker 2.
RAY_CPUS = 4
JAX_HOST_DEVICES = 8
#: Rows per HF generate call / JAX decode chunk of every pooled policy (5-row batches: chunks).
GENERATION_BATCH_SIZE = 2


def layout_params(names: list[str] | None = None, slow: set[str] | None = None) -> list:
    """``pytest.param`` per layout name, id = the name, the slow ones marked."""
    slow = SLOW_LAYOUTS if slow is None else slow
    return [
        pytest.param(name, id=name, marks=[pytest.mark.slow] if name in slow else [])
        for name in (LAYOUTS if names is None else names)
    ]


def layout_config(layout: str | Layout, model_dir: Path, **overrides: Any) -> dict:
    """The test policy config (``policy_config``) on ``layout``: backend, parallel sizes,
    context parallel with its sequence multiple, packing, compile; ``overrides`` last."""
    lay = parse_layout(layout) if isinstance(layout, str) else layout
    if lay.per_host and lay.devices != JAX_HOST_DEVICES:
        raise ValueError(
            f"layout {lay.name!r} is a mesh of {lay.devices} devices; the test session's JAX worker owns "
            f"{JAX_HOST_DEVICES} (tests/conftest.py XLA_FLAGS)"
        )
    cfg = apply_settings(policy_config(model_dir, lay.backend), lay.policy_settings())
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def cpus_of(layout: Layout) -> int:
    return 2 if layout.per_host else layout.workers


def layout_cluster(layout: Layout, name: str):
    """A Ray cluster for ``layout``: one 1-CPU bundle per torch worker; one 2-CPU bundle for
    the JAX worker (it owns the host's devices)."""
    from core.distributed import RayVirtualCluster

    if layout.per_host:
        return RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2, name=name)
    return RayVirtualCluster([layout.workers], use_gpus=False, name=name)


@contextlib.contextmanager
def started_policy(layout: Layout, cfg: dict, tokenizer, name: str, **policy_kwargs: Any) -> Iterator[Any]:
    """A ``Policy`` on its own cluster for ``layout``; both shut down on exit."""
    from core.policy import Policy

    cluster = layout_cluster(layout, name)
    try:
        policy = Policy(cluster, cfg, tokenizer, name_prefix=name, **policy_kwargs)
        try:
            yield policy
        finally:
            policy.shutdown()
    finally:
        cluster.shutdown()


class NoWorkers:
    """A cluster no worker may start on: a ``Policy`` built on it must be refused on the driver
    (config, preflight, checkpoint checks) -- anything further fails here, at once, instead of
    waiting for CPUs that the pooled policy holds."""

    def __init__(self, layout: Layout) -> None:
        self.bundle_ct_per_node_list = [layout.workers]

    def __getattr__(self, name: str):
        raise AssertionError(f"not refused on the driver: the Policy went on to start workers (cluster.{name})")


def refused_on_driver(layout: Layout, cfg: dict, tokenizer, **policy_kwargs: Any) -> None:
    """Build a ``Policy`` that must be refused before any worker starts (the caller wraps this
    in ``pytest.raises``)."""
    from core.policy import Policy

    Policy(NoWorkers(layout), cfg, tokenizer, **policy_kwargs)


class LogitsOnlyNLL:
    """A user loss with the least a loss must have (``core.interfaces.LossFunction``): a
    ``loss_type`` and a call on the full logits -- no ``loss_from_logprobs``.  ``setting``: any
    value the loss carries (it does not change the result)."""

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self, setting: Any = None) -> None:
        self.setting = setting

    def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks):
        return NLLLoss()(next_token_logits, data, global_valid_seqs, global_valid_toks)


def ragged(batch: int, seed: int, vocab: int = VOCAB) -> Any:
    """``{input_ids, input_lengths}``: right-padded random rows of ragged lengths."""
    from core.data import BatchedDataDict

    ids, lens = random_batch(batch, SEQ, vocab, seed=seed)
    return BatchedDataDict(input_ids=ids, input_lengths=lens)


def read_refit_stream(policy, bucket_bytes: int = 48 * 1024) -> list[tuple[str, Any]]:
    """The policy's refit stream through the IPC transport (a shared-memory segment per
    bucket on CPU), in stream order, in buckets of at most ``bucket_bytes``."""
    from core.refit.shm import open_bucket

    plan = policy.prepare_weights_for_ipc(bucket_bytes / 2**30)
    assert len(plan) > 1  # several buckets: the plan, not one whole-model copy
    items = []
    try:
        for keys in plan:
            bucket = [(name, tensor.clone()) for name, tensor in open_bucket(policy.get_weights_ipc_handles(keys))]
            assert [name for name, _ in bucket] == keys
            items += bucket
    finally:
        policy.finish_refit_stream()
    return items


# ----------------------------------------------------------------------------- the pool


@dataclass
class LayoutPolicy:
    """A pooled policy with what the tests need to know about it."""

    layout: Layout
    policy: Any
    cfg: dict
    model_dir: Path
    initial: tuple[Path, Path]  # (weights, optimizer) checkpoint of the state it started in
    dirty: bool = False  # trained or loaded since it was last in its initial state
    _cfg0: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.layout.name

    def reset(self) -> None:
        """Back to the initial state: the driver's config, and the initial checkpoint (weights,
        optimizer moments, LR schedule, step) loaded into every worker."""
        self.policy.cfg = copy.deepcopy(self._cfg0)
        if self.dirty:
            self.policy.workers.all(PolicyWorker.load_checkpoint, str(self.initial[0]), str(self.initial[1]))
            self.dirty = False


def _start_layout_policy(stack: contextlib.ExitStack, layout: Layout, cfg: dict, model_dir, tokenizer, root: Path):
    policy = stack.enter_context(started_policy(layout, cfg, tokenizer, f"contract_{layout.name}"))
    initial = (root / "initial_weights", root / "initial_optim")
    policy.save_checkpoint(str(initial[0]), str(initial[1]))
    lp = LayoutPolicy(layout, policy, cfg, Path(model_dir), initial, _cfg0=copy.deepcopy(policy.cfg))
    train = policy.train

    def tracked_train(*args, **kwargs):  # anything that may move the weights marks the policy dirty
        lp.dirty = lp.dirty or not kwargs.get("eval_mode", False)
        return train(*args, **kwargs)

    policy.train = tracked_train
    return lp


class PolicyPool:
    """At most one live pooled policy; asking for another key shuts the current one down."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.key: Any = None
        self.value: Any = None
        self.stack = contextlib.ExitStack()
        self.starts: list[Any] = []

    def get(self, key: Any, start: Callable[[contextlib.ExitStack, Path], Any]) -> Any:
        if key != self.key:
            self.close()
            self.stack = contextlib.ExitStack()
            root = self.root / "_".join(map(str, key))
            root.mkdir(parents=True, exist_ok=True)
            self.value, self.key = start(self.stack, root), key
            self.starts.append(key)
        return self.value

    def close(self) -> None:
        self.key = self.value = None
        self.stack.close()

    def make_room(self, layout: Layout) -> None:
        """Shut the pooled policy down if a second policy on ``layout`` would not fit Ray's CPUs
        beside it (the pool starts it again for the next test that asks)."""
        held = cpus_of(self.value.layout) if self.value is not None else 0
        if held + cpus_of(layout) > RAY_CPUS:
            self.close()


@pytest.fixture(scope="package")
def policies(ray_session, tmp_path_factory):
    pool = PolicyPool(tmp_path_factory.mktemp("contract_policies"))
    yield pool
    pool.close()


@pytest.fixture(params=layout_params())
def layout(request) -> Layout:
    """The layout of the test (its id); a test narrows the list with its own ``parametrize``."""
    return parse_layout(request.param)


@pytest.fixture
def layout_policy(layout, policies, model_dirs, tokenizer) -> LayoutPolicy:
    """The pooled policy of ``layout`` (model ``MODEL_OF``), in whatever state the previous
    test of the layout left it."""
    model_dir = model_dirs[MODEL_OF[layout.name]]
    cfg = layout_config(layout, model_dir, generation_batch_size=GENERATION_BATCH_SIZE)
    cfg["generation"]["vllm_cfg"]["precision"] = "bfloat16"  # the refit stream casts on the workers
    return policies.get(
        ("contract", layout.name),
        lambda stack, root: _start_layout_policy(stack, layout, cfg, model_dir, tokenizer, root),
    )


@pytest.fixture
def fresh_policy(layout_policy) -> LayoutPolicy:
    """The pooled policy of ``layout`` in its initial state."""
    layout_policy.reset()
    return layout_policy


def pytest_collection_modifyitems(config, items):
    """Run this package's tests layout by layout (stable: module and definition order kept
    within a layout), so the pool starts each layout's policies once."""
    here = Path(__file__).parent
    mine = [i for i, item in enumerate(items) if here in Path(str(item.path)).parents]
    if not mine:
        return
    order = {name: n for n, name in enumerate(LAYOUTS)}

    def key(item) -> tuple[int, int]:
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = params.get("layout")
        name = name.name if isinstance(name, Layout) else name
        return (order.get(name, len(order)), 1 if "padded" in item.nodeid else 0)

    ordered = sorted((items[i] for i in mine), key=key)
    for i, item in zip(mine, ordered, strict=True):
        items[i] = item
