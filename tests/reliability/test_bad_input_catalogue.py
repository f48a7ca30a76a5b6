"""A catalogue of bad inputs and misuse, each tried through the public API as a new user would.

Every case must end, within ``DEADLINE_S``, in a clear error (its type, and a message naming
the key / field / path / row at fault) -- or, for the cases marked ``skipped``, in a skipped
optimizer step -- and leave its target as it was: after every case the policy's logprobs on a
probe batch are bitwise what they were before (no weight moved), and the engine's greedy
continuation of the probe prompts is unchanged (it still serves, with the same weights).

Targets: a torch FSDP1 dp=2 policy, a JAX policy, a vLLM engine (real weights, no refit
needed), and the worker groups behind them, called directly to bypass the driver's checks
(then the failure must be recoverable: raised before any collective, group alive).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from core.checkpointing.manifest import CheckpointError
from core.config import ConfigError
from core.data import BatchedDataDict
from core.distributed import RecoverableCallError
from core.losses import ClippedPGLossFn, LossInputError
from core.policy.checks import BatchError
from core.testing.tiny_models import random_batch
from tests.torch_backends.conftest import SEQ, VOCAB, pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG

DEADLINE_S = 20.0  # each case, start to error (a vLLM hang used to last > 90 s)


@dataclass
class Env:
    policy: Any
    jax_policy: Any
    engine: Any
    cfg: dict
    model_dir: Path
    tmp: Path
    tokenizer: Any
    spare_cluster: Any


@dataclass
class Case:
    name: str
    target: str  # "policy" | "jax" | "engine"
    call: Callable[[Env], Any]
    error: Any  # exception type(s), or "skipped" for a step that must be skipped, not raised
    match: str = ""


# ----------------------------------------------------------------------------- batches
def probe() -> BatchedDataDict:
    ids, lens = random_batch(4, SEQ, VOCAB, seed=7, min_len=4)
    return BatchedDataDict(input_ids=ids, input_lengths=lens)


def prompts() -> BatchedDataDict:
    ids, lens = random_batch(2, 8, VOCAB, seed=9, min_len=3)
    ids[:, 0] = 1
    return BatchedDataDict(input_ids=ids, input_lengths=lens)


def with_(data: BatchedDataDict, **changes) -> BatchedDataDict:
    out = BatchedDataDict({k: v.clone() if torch.is_tensor(v) else v for k, v in data.items()})
    for key, value in changes.items():
        if value is None:
            del out[key]
        else:
            out[key] = value(out[key]) if callable(value) else value
    return out


def at(value, row=1, col=3):
    """A function setting element [row, col] (or [row]) of a tensor copy to ``value``."""

    def change(t):
        t = t.clone()
        t[(row, col) if t.ndim == 2 else row] = value
        return t

    return change


_PG_LOSS = object()


def train(target: str, data_fn, loss=_PG_LOSS, **kwargs):
    def run(env: Env):
        policy = env.jax_policy if target == "jax" else env.policy
        return policy.train(data_fn(), ClippedPGLossFn(BASE_CFG) if loss is _PG_LOSS else loss, **kwargs)

    return run


def logprobs(target: str, data_fn):
    return lambda env: (env.jax_policy if target == "jax" else env.policy).get_logprobs(data_fn())


def generate(data_fn, **kwargs):
    return lambda env: env.engine.generate(data_fn(), greedy=True, **kwargs)


class NotALoss:
    def __call__(self, logits, data):
        return logits.sum(), {}


def _worker_direct(method: str, *args):
    """Call the policy's workers directly, past the driver's checks."""

    def run(env: Env):
        group = env.policy.worker_group
        return group.get_all_worker_results(group.run_all_workers_single_data(method, *args))

    return run


def _engine_direct(data_fn):
    """Call the engine actor directly, past VllmGeneration's checks."""

    def run(env: Env):
        import ray

        data = data_fn()
        rows = {k: v.numpy() for k, v in data.items()}
        return ray.get(env.engine.engines[0].generate.remote(rows, True), timeout=DEADLINE_S)

    return run


def _new_policy(**changes):
    def run(env: Env):
        from core.policy import Policy

        cfg = {**env.cfg, **{k: v for k, v in changes.items() if k not in ("weights_path",)}}
        kwargs = {"weights_path": changes["weights_path"](env)} if "weights_path" in changes else {}
        Policy(env.spare_cluster, cfg, env.tokenizer, name_prefix="catalogue_new", **kwargs).shutdown()

    return run


def _file(env: Env) -> Path:
    f = env.tmp / "a_file.txt"
    f.write_text("not a directory")
    return f


def _nan(t):
    t = t.float().clone()
    t[1, 4] = float("nan")
    return t


LENGTHS_WIDER = lambda t: t.clone().fill_(SEQ + 1)  # noqa: E731
pg = lambda **c: lambda: with_(pg_batch(4, seed=11), **c)  # noqa: E731
lp = lambda **c: lambda: with_(probe(), **c)  # noqa: E731
pr = lambda **c: lambda: with_(prompts(), **c)  # noqa: E731

CASES = [
    # ---- get_logprobs on the driver (torch)
    Case(
        "logprobs: id >= vocab",
        "policy",
        logprobs("policy", lp(input_ids=at(VOCAB))),
        BatchError,
        r"\['input_ids'\]\[1, 3\] = 256 is outside the vocabulary \[0, 256\)",
    ),
    Case(
        "logprobs: negative id",
        "policy",
        logprobs("policy", lp(input_ids=at(-1))),
        BatchError,
        "outside the vocabulary",
    ),
    Case(
        "logprobs: id >= vocab in the padding",
        "policy",
        logprobs("policy", lp(input_ids=at(10**6, 0, SEQ - 1), input_lengths=at(3, 0))),
        BatchError,
        "padding must be a valid id",
    ),
    Case(
        "logprobs: float input_ids",
        "policy",
        logprobs("policy", lp(input_ids=lambda t: t.float())),
        BatchError,
        r"\['input_ids'\] must hold integers, got dtype torch.float32",
    ),
    Case(
        "logprobs: bool input_ids",
        "policy",
        logprobs("policy", lp(input_ids=lambda t: t > 5)),
        BatchError,
        "must hold integers",
    ),
    Case(
        "logprobs: float input_lengths",
        "policy",
        logprobs("policy", lp(input_lengths=lambda t: t.float())),
        BatchError,
        r"\['input_lengths'\] must hold integers",
    ),
    Case("logprobs: empty batch", "policy", logprobs("policy", lambda: probe().slice(0, 0)), BatchError, "empty batch"),
    Case(
        "logprobs: missing input_lengths",
        "policy",
        logprobs("policy", lp(input_lengths=None)),
        BatchError,
        "missing 'input_lengths'",
    ),
    Case(
        "logprobs: 3-D input_ids",
        "policy",
        logprobs("policy", lp(input_ids=lambda t: t[:, :, None])),
        BatchError,
        r"must be \[B, S\]",
    ),
    Case(
        "logprobs: lengths of another batch",
        "policy",
        logprobs("policy", lp(input_lengths=lambda t: t[:3])),
        BatchError,
        r"must have shape \(4,\)",
    ),
    Case(
        "logprobs: a zero length",
        "policy",
        logprobs("policy", lp(input_lengths=at(0, 2))),
        BatchError,
        r"must lie in \[1, 12\]",
    ),
    Case(
        "logprobs: length beyond the width",
        "policy",
        logprobs("policy", lp(input_lengths=LENGTHS_WIDER)),
        BatchError,
        r"must lie in \[1, 12\]",
    ),
    Case(
        "logprobs: longer than max_total_sequence_length",
        "policy",
        logprobs(
            "policy",
            lambda: BatchedDataDict(input_ids=torch.ones(2, 40, dtype=torch.long), input_lengths=torch.tensor([40, 3])),
        ),
        BatchError,
        "policy.max_total_sequence_length is 32",
    ),
    # ---- train on the driver (torch)
    Case(
        "train: loss_fn is a lambda",
        "policy",
        train("policy", pg(), loss=lambda *a: 0.0),
        TypeError,
        "loss_fn must be a core.interfaces.LossFunction",
    ),
    Case("train: loss_fn is None", "policy", train("policy", pg(), loss=None), TypeError, "got NoneType"),
    Case(
        "train: loss_fn without loss_type", "policy", train("policy", pg(), loss=NotALoss()), TypeError, "got NotALoss"
    ),
    Case(
        "train: NaN in token_mask",
        "policy",
        train("policy", pg(token_mask=_nan)),
        BatchError,
        r"\['token_mask'\]\[1, 4\] = nan: masks must be finite",
    ),
    Case(
        "train: NaN in sample_mask",
        "policy",
        train("policy", pg(sample_mask=at(float("nan"), 2))),
        BatchError,
        r"\['sample_mask'\]\[2\] = nan",
    ),
    Case("train: token_mask of 2", "policy", train("policy", pg(token_mask=at(2.0))), BatchError, r"in \[0, 1\]"),
    Case(
        "train: negative sample_mask",
        "policy",
        train("policy", pg(sample_mask=at(-1.0, 0))),
        BatchError,
        r"\['sample_mask'\]\[0\] = -1.0",
    ),
    Case("train: no sample_mask", "policy", train("policy", pg(sample_mask=None)), BatchError, "missing 'sample_mask'"),
    Case(
        "train: gbs not divisible by dp x mbs",
        "policy",
        train("policy", pg(), gbs=3),
        BatchError,
        "not divisible by data-parallel size 2 x micro batch size",
    ),
    Case(
        "train: rows not a multiple of gbs",
        "policy",
        train("policy", lambda: pg_batch(4, 3).slice(0, 3)),
        BatchError,
        "not a positive multiple of the global batch size",
    ),
    Case(
        "train: no advantages",
        "policy",
        train("policy", pg(advantages=None)),
        LossInputError,
        r"missing key\(s\) \['advantages'\]",
    ),
    Case(
        "train: NaN advantages",
        "policy",
        train("policy", pg(advantages=_nan)),
        LossInputError,
        r"data\['advantages'\] has non-finite values",
    ),
    Case(
        "train: advantages of another shape",
        "policy",
        train("policy", pg(advantages=lambda t: t[:, :5])),
        LossInputError,
        r"data\['advantages'\] has shape \(4, 5\)",
    ),
    Case(
        "train: id >= vocab",
        "policy",
        train("policy", pg(input_ids=at(VOCAB + 5))),
        BatchError,
        "outside the vocabulary",
    ),
    Case(
        "train: float input_ids",
        "policy",
        train("policy", pg(input_ids=lambda t: t.double())),
        BatchError,
        "must hold integers",
    ),
    Case(
        "train: advantages of 1e30 (infinite grad norm)",
        "policy",
        train("policy", pg(advantages=lambda t: t * 1e30)),
        "skipped",
        "non_finite",
    ),
    Case(
        "train: no valid token", "policy", train("policy", pg(token_mask=lambda t: t * 0)), "skipped", "no_valid_tokens"
    ),
    # ---- checkpoints and exports (torch)
    Case(
        "save_checkpoint under a file",
        "policy",
        lambda env: env.policy.save_checkpoint(str(_file(env) / "w")),
        CheckpointError,
        "is a file, not a directory",
    ),
    Case(
        "save_checkpoint into /proc",
        "policy",
        lambda env: env.policy.save_checkpoint("/proc/dualrl/w"),
        CheckpointError,
        "cannot create directories in '/proc'",
    ),
    Case(
        "save_checkpoint: weights == optimizer dir",
        "policy",
        lambda env: env.policy.save_checkpoint(str(env.tmp / "same"), str(env.tmp / "same")),
        CheckpointError,
        "weights_path and optimizer_path are the same directory",
    ),
    Case(
        "save_checkpoint over a plain file",
        "policy",
        lambda env: env.policy.save_checkpoint(str(_file(env))),
        CheckpointError,
        "is a file; refusing to replace it",
    ),
    Case(
        "save_hf_checkpoint into /proc",
        "policy",
        lambda env: env.policy.save_hf_checkpoint("/proc/dualrl/hf"),
        CheckpointError,
        "save_hf_checkpoint: path='/proc/dualrl/hf'",
    ),
    Case(
        "generate (HF): prompt as wide as the context",
        "policy",
        lambda env: env.policy.generate(
            BatchedDataDict(input_ids=torch.ones(2, 32, dtype=torch.long), input_lengths=torch.tensor([32, 5]))
        ),
        BatchError,
        "prompts are 32 tokens wide but policy.max_total_sequence_length=32",
    ),
    # ---- construction, refused before any worker starts
    Case(
        "Policy: model path that does not exist",
        "policy",
        _new_policy(model_name="/nonexistent/model"),
        FileNotFoundError,
        "policy.model_name: no such directory: /nonexistent/model",
    ),
    Case(
        "Policy: unknown backend",
        "policy",
        _new_policy(backend="torch_fsdp3"),
        ConfigError,
        r"policy\.backend: 'torch_fsdp3' is not a registered backend; "
        r"known: \['torch_fsdp', 'torch_dtensor', 'jax_pjit'\]",
    ),
    Case(
        "Policy: train_global_batch_size not divisible",
        "policy",
        _new_policy(train_global_batch_size=5),
        ConfigError,
        r"policy.train_global_batch_size: 5 is not divisible",
    ),
    Case(
        "Policy: weights_path that does not exist",
        "policy",
        _new_policy(weights_path=lambda env: env.tmp / "no_such_ckpt"),
        CheckpointError,
        "no_such_ckpt",
    ),
    # ---- past the driver: the workers refuse before any collective and the group lives
    Case(
        "workers: save_checkpoint into /proc (driver bypassed)",
        "policy",
        _worker_direct("save_checkpoint", "/proc/dualrl/w2", None, None),
        RecoverableCallError,
        r"(?s)CheckpointError: .*cannot create directories in '/proc'.*alive and usable",
    ),
    Case(
        "workers: get_logprobs with id >= vocab (driver bypassed)",
        "policy",
        _worker_direct("get_logprobs", with_(probe(), input_ids=at(VOCAB))),
        RecoverableCallError,
        r"(?s)BatchError: .*outside the vocabulary.*alive and usable",
    ),
    Case(
        "workers: train with a loss that is not a LossFunction (driver bypassed)",
        "policy",
        _worker_direct("train", pg_batch(2, 3), NotALoss(), False, 2, 1),
        RecoverableCallError,
        r"(?s)TypeError: loss_fn must be.*alive and usable",
    ),
    # ---- JAX (ids used to wrap or turn into NaN silently)
    Case(
        "jax logprobs: id >= vocab",
        "jax",
        logprobs("jax", lp(input_ids=at(VOCAB))),
        BatchError,
        "outside the vocabulary",
    ),
    Case(
        "jax logprobs: negative id",
        "jax",
        logprobs("jax", lp(input_ids=at(-3))),
        BatchError,
        r"= -3 is outside the vocabulary",
    ),
    Case("jax train: NaN token_mask", "jax", train("jax", pg(token_mask=_nan)), BatchError, "masks must be finite"),
    Case(
        "jax train: advantages of 1e30", "jax", train("jax", pg(advantages=lambda t: t * 1e30)), "skipped", "non_finite"
    ),
    # ---- vLLM engine (used to hang for good on some of these)
    Case(
        "engine: id >= vocab",
        "engine",
        generate(pr(input_ids=at(VOCAB, 0, 2))),
        BatchError,
        r"\['input_ids'\]\[0, 2\] = 256 is outside the vocabulary",
    ),
    Case("engine: negative id", "engine", generate(pr(input_ids=at(-2, 0, 2))), BatchError, "outside the vocabulary"),
    Case("engine: float ids", "engine", generate(pr(input_ids=lambda t: t.float())), BatchError, "must hold integers"),
    Case(
        "engine: prompt as wide as the context",
        "engine",
        generate(
            lambda: BatchedDataDict(input_ids=torch.ones(2, 32, dtype=torch.long), input_lengths=torch.tensor([32, 4]))
        ),
        BatchError,
        "no room to generate a token",
    ),
    Case("engine: empty batch", "engine", generate(lambda: prompts().slice(0, 0)), BatchError, "empty batch"),
    Case(
        "engine: sample_seeds of the wrong shape",
        "engine",
        generate(pr(sample_seeds=torch.tensor([[1], [2]]))),
        ValueError,
        r"sample_seeds'\] must be a \[B\] = \(2,\) integer array",
    ),
    Case(
        "engine: negative sample seed",
        "engine",
        generate(pr(sample_seeds=torch.tensor([1, -5]))),
        ValueError,
        r"row 1 has -5",
    ),
    Case(
        "engine: id >= vocab (driver bypassed)",
        "engine",
        _engine_direct(pr(input_ids=at(VOCAB + 1, 1, 1))),
        BatchError,
        r"engine input\['input_ids'\]\[1, 1\] = 257 is outside the vocabulary",
    ),
    Case(
        "engine: float ids (driver bypassed)",
        "engine",
        _engine_direct(pr(input_ids=lambda t: t.float() + 0.5)),
        BatchError,
        r"engine input\['input_ids'\] must hold integers",
    ),
    Case(
        "engine: refit manifest of another model",
        "engine",
        lambda env: env.engine.prepare_refit_info({"model.embed_tokens.weight": ((7, 3), "float32")}),
        Exception,
        "model.embed_tokens.weight",
    ),
]


def test_the_catalogue_is_large_and_distinct():
    names = [c.name for c in CASES]
    assert len(names) >= 40 and len(set(names)) == len(names)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def env(ray_session, model_dirs, tokenizer, tmp_path_factory):
    from core.distributed import RayVirtualCluster
    from core.generation import VllmGeneration
    from core.policy import Policy
    from core.testing.tiny_models import save_tiny_model
    from tests.generation.conftest import refit_config

    tmp = tmp_path_factory.mktemp("catalogue")
    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    jax_cfg = policy_config(model_dirs["llama"], "jax_pjit")
    jax_cfg["parallel"].update(fsdp_size=4, tensor_parallel_size=2)
    gen_dir = save_tiny_model("llama_gen", tmp / "llama_gen")
    gen_cfg = refit_config(gen_dir, "torch_fsdp")
    gen_cfg["max_total_sequence_length"] = 32
    # real weights: serves without a refit; a hung call is reported within a minute
    gen_cfg["generation"]["vllm_cfg"].update(load_format="auto", call_timeout_s=60)
    # The spare cluster is for the construction cases, which must fail before any worker
    # starts: a sliver of CPU each, so that a regression starts workers instead of hanging.
    # The session has 4 CPUs: torch 2 + JAX 1 + engine 0.9 + spare 2 x 0.01.
    clusters = [
        RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=0.01, name="catalogue-spare"),
        RayVirtualCluster([2], use_gpus=False, name="catalogue-torch"),
        RayVirtualCluster([1], use_gpus=False, name="catalogue-jax"),
        RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=0.9, name="catalogue-engine"),
    ]
    handles = []
    try:
        handles.append(Policy(clusters[1], cfg, tokenizer, name_prefix="catalogue_torch"))
        handles.append(Policy(clusters[2], jax_cfg, tokenizer, name_prefix="catalogue_jax"))
        handles.append(
            VllmGeneration(clusters[3], gen_cfg, tokenizer, name_prefix="catalogue_engine", probe_timeout_s=20)
        )
        yield Env(
            *handles, cfg=cfg, model_dir=model_dirs["llama"], tmp=tmp, tokenizer=tokenizer, spare_cluster=clusters[0]
        )
    finally:
        for h in handles:
            h.shutdown()
        for c in clusters:
            c.shutdown()


def _fingerprint(env: Env, target: str) -> torch.Tensor:
    if target == "engine":
        return env.engine.generate(prompts(), greedy=True)["output_ids"]
    policy = env.jax_policy if target == "jax" else env.policy
    return policy.get_logprobs(probe())["logprobs"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_clearly_and_changes_nothing(case: Case, env: Env):
    before = _fingerprint(env, case.target)
    start = time.monotonic()
    if case.error == "skipped":
        result = case.call(env)
        assert result.skipped_steps == len(result.loss) >= 1, result.skip_reasons
        assert all(r.startswith(case.match) for r in result.skip_reasons), result.skip_reasons
    else:
        with pytest.raises(case.error, match=case.match):
            case.call(env)
    assert time.monotonic() - start < DEADLINE_S, f"{case.name}: took {time.monotonic() - start:.1f} s"
    after = _fingerprint(env, case.target)  # the target still answers ...
    assert torch.equal(before, after), f"{case.name}: the weights changed"  # ... with the same weights
