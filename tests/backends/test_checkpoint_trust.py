"""Policy checkpoints you can trust, on every backend: atomic saves, verified loads, clear refusals.

Through the Policy, per layout: a save / load round trip resumes the uninterrupted next step
(and a new Policy started from the checkpoint does too); a damaged (corrupt, truncated, no
manifest), mislabelled (weights and optimizer swapped or of different saves, the other
backend's format, a missing required file) checkpoint is refused on the driver before any
worker starts; a checkpoint of another model is refused in the workers, naming the key and
the shapes, and the policy goes on serving its own weights.

In this process, per checkpoint format (torch DCP: both torch backends; orbax: JAX), the
atomicity: a save killed before its manifest or between its renames keeps the previous
checkpoint loadable and leaves nothing that passes for complete; a failed save cleans up; a
directory that is not a checkpoint is never replaced; the workers' own size check (the driver
checksums) names a truncated shard.  The multi-rank kill (rank 0 dying mid-save) and DCP's
scheduler file: tests/torch_backends/test_checkpoint_trust.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.lib.layouts import parse_layout
from core.checkpointing import policy_files as pf
from core.checkpointing.manifest import MANIFEST_NAME, CheckpointError
from core.losses import ClippedPGLossFn
from core.policy.registry import backend_spec
from core.policy.worker_protocol import PolicyWorker
from core.testing.tiny_models import save_tiny_model
from tests.backends.conftest import (
    LAYOUTS,
    MODEL_OF,
    layout_config,
    layout_params,
    ragged,
    refused_on_driver,
    started_policy,
)
from tests.hf_reference import PG_CFG
from tests.logs import warns
from tests.torch_backends.conftest import pg_batch

# ----------------------------------------------------------------------------- formats, in process


class DcpFormat:
    """torch DCP (both torch backends), driven in this process on HF models (no process group)."""

    name = "torch-dcp"

    def state(self, model_dir: Path, seed: int = 0):
        from tests.torch_backends.test_checkpoint_trust import perturbed_model

        model, optimizer = perturbed_model(model_dir, seed)
        ids = torch.randint(4, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()  # moments and a step count to save
        optimizer.zero_grad()
        return model, optimizer

    def save(self, state, weights: Path, optim: Path | None, step: int = 3) -> None:
        from backends.torch_common import checkpoint as ckpt

        model, optimizer = state
        ckpt.save_dcp(model, weights, optimizer, optim, {"train_step": step}, train_step=step)

    def load(self, model_dir: Path, weights: Path, optim: Path | None, checksums: bool = True):
        """(state, step) loaded into a fresh state of ``model_dir``'s model."""
        from backends.torch_common import checkpoint as ckpt

        state = self.state(model_dir, seed=99)
        extra = ckpt.load_dcp(*state[:1], weights, state[1], optim, checksums=checksums)
        return state, extra.get("train_step")

    def values(self, state) -> list[np.ndarray]:
        model, optimizer = state
        out = [p.detach().numpy().copy() for p in model.parameters()]
        for s in optimizer.state.values():
            out += [v.numpy().copy() for v in s.values() if isinstance(v, torch.Tensor)]
        return out


class OrbaxFormat:
    """orbax (JAX), driven in this process on the params of the tiny HF models."""

    name = "orbax"

    def state(self, model_dir: Path, seed: int = 0):
        import jax
        import jax.numpy as jnp
        import optax

        from backends.jax_pjit.hf_mapping import from_pretrained
        from backends.jax_pjit.models import make_apply_fn

        model, _, _ = from_pretrained(
            str(model_dir), dtype=jnp.float32, param_dtype=jnp.float32, tp=1, make_vocab_size_divisible_by=1
        )
        _, params = make_apply_fn(model)
        key = jax.random.PRNGKey(seed)
        params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(key, x.shape, x.dtype), params)
        return params, optax.adamw(1e-2).init(params)

    def save(self, state, weights: Path, optim: Path | None, step: int = 3) -> None:
        from backends.jax_pjit import checkpoint as jckpt

        jckpt.save_orbax(state[0], state[1], step, weights, optim)

    def load(self, model_dir: Path, weights: Path, optim: Path | None, checksums: bool = True):
        from backends.jax_pjit import checkpoint as jckpt

        fresh = self.state(model_dir, seed=99)
        params, opt_state, step = jckpt.load_orbax(fresh[0], fresh[1], weights, optim, checksums=checksums)
        return (params, opt_state), step

    def values(self, state) -> list[np.ndarray]:
        import jax

        return [np.asarray(x) for x in jax.tree.leaves(state)]


FORMATS = {f.name: f for f in (DcpFormat(), OrbaxFormat())}
#: The format of each layout's checkpoints, and the formats the layouts use.
FORMAT_OF = {name: backend_spec(parse_layout(name).backend).checkpoint_format for name in LAYOUTS}
FORMAT_PARAMS = [pytest.param(FORMATS[f], id=f) for f in sorted(set(FORMAT_OF.values()))]


def _same(fmt, a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(fmt.values(a), fmt.values(b), strict=True))


def _biggest_file(path: Path) -> Path:
    """The largest data file of a checkpoint directory (a DCP shard, an orbax array file)."""
    return max((p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST_NAME), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def foreign_checkpoints(model_dirs, tmp_path_factory):
    """``checkpoints(format, model) -> weights dir``: weights of another tiny model, written in
    ``format`` in this process (each once)."""
    root = tmp_path_factory.mktemp("foreign_ckpts")
    cache: dict[tuple[str, str], Path] = {}

    def get(fmt: str, model: str) -> Path:
        if (fmt, model) not in cache:
            model_dir = model_dirs.get(model) or save_tiny_model(model, root / model)
            path = root / f"{fmt}_{model}"
            FORMATS[fmt].save(FORMATS[fmt].state(model_dir), path, None)
            cache[fmt, model] = path
        return cache[fmt, model]

    return get


# ----------------------------------------------------------------------------- through the Policy


def test_round_trip_resumes_the_uninterrupted_step(fresh_policy, tmp_path):
    lp = fresh_policy
    policy, fmt = lp.policy, FORMAT_OF[lp.name]
    loss_fn = ClippedPGLossFn(PG_CFG)
    b1, b2, probe = pg_batch(4, seed=40), pg_batch(4, seed=41), ragged(4, seed=42)
    policy.train(b1, loss_fn)
    policy.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optim"), str(tmp_path / "tok"))
    for path, kind in ((tmp_path / "weights", pf.KIND_WEIGHTS), (tmp_path / "optim", pf.KIND_OPTIMIZER)):
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        assert manifest["identity"]["kind"] == kind and manifest["identity"]["format"] == fmt
        assert manifest["step"] == 1 and manifest["files"]
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp / old left
    uninterrupted = policy.train(b2, loss_fn)
    expected_lp = policy.get_logprobs(probe)["logprobs"]

    policy.workers.all(PolicyWorker.load_checkpoint, str(tmp_path / "weights"), str(tmp_path / "optim"))
    step = policy.train(b2, loss_fn)
    assert math.isclose(float(step.loss[0]), float(uninterrupted.loss[0]), rel_tol=1e-6, abs_tol=1e-7)
    assert math.isclose(float(step.grad_norm[0]), float(uninterrupted.grad_norm[0]), rel_tol=1e-5)
    assert step.lr == pytest.approx(uninterrupted.lr)  # scheduler state restored
    # Same Adam moments => same update => same weights after the step.
    torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], expected_lp, rtol=0, atol=1e-5)


#: A new Policy started from a layout's checkpoint: the same layout, except that an FSDP1
#: checkpoint starts a DTensor tp=2 + SP policy (DCP reshards by HF parameter name, so a run
#: can move between the torch backends).
RESUME_INTO = {"fsdp1-dp2": "dtensor-tp2-sp"}


@pytest.mark.parametrize("layout", layout_params(slow=set(LAYOUTS) - {"fsdp1-dp2"}), indirect=True)
def test_a_new_policy_resumes_from_the_checkpoint(fresh_policy, policies, tokenizer, tmp_path):
    lp = fresh_policy
    loss_fn = ClippedPGLossFn(PG_CFG)
    b1, b2, probe = pg_batch(4, seed=40), pg_batch(4, seed=41), ragged(4, seed=42)
    lp.policy.train(b1, loss_fn)
    lp.policy.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optim"))
    uninterrupted = lp.policy.train(b2, loss_fn)
    expected_lp = lp.policy.get_logprobs(probe)["logprobs"]

    into = RESUME_INTO.get(lp.name, lp.name)
    cfg = layout_config(into, lp.model_dir)
    policies.make_room(parse_layout(into))
    with started_policy(
        parse_layout(into),
        cfg,
        tokenizer,
        "resumed",
        weights_path=tmp_path / "weights",
        optimizer_path=tmp_path / "optim",
    ) as resumed:
        step = resumed.train(b2, loss_fn)
        assert math.isclose(float(step.loss[0]), float(uninterrupted.loss[0]), rel_tol=1e-6, abs_tol=1e-7)
        assert math.isclose(float(step.grad_norm[0]), float(uninterrupted.grad_norm[0]), rel_tol=1e-5)
        assert step.lr == pytest.approx(uninterrupted.lr)
        torch.testing.assert_close(resumed.get_logprobs(probe)["logprobs"], expected_lp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "no_manifest"])
def test_a_damaged_checkpoint_is_refused_on_the_driver(layout_policy, damage, tokenizer, tmp_path):
    """Each refusal names the file and the path, before any worker starts."""
    lp = layout_policy
    weights, optim = tmp_path / "weights", tmp_path / "optim"
    shutil.copytree(lp.initial[0], weights)
    shutil.copytree(lp.initial[1], optim)
    target = _biggest_file(weights)
    size = target.stat().st_size
    if damage == "corrupt":  # 4 KiB overwritten in the middle: same size, different bytes
        with open(target, "r+b") as f:
            f.seek(size // 2)
            f.write(os.urandom(min(4096, size // 2)))
        match = f"{target.name}.*is corrupt: sha256"
    elif damage == "truncate":
        with open(target, "r+b") as f:
            f.truncate(size // 2)
        match = f"{target.name}.*truncated"
    else:
        (weights / MANIFEST_NAME).unlink()
        match = r"incomplete checkpoint: weights_path=.*has no checkpoint\.json"
    with pytest.raises(CheckpointError, match=match) as err:
        refused_on_driver(lp.layout, lp.cfg, tokenizer, weights_path=weights, optimizer_path=optim)
    assert str(weights) in str(err.value)


def test_a_mislabelled_checkpoint_is_refused_on_the_driver(layout_policy, foreign_checkpoints, tokenizer, tmp_path):
    lp = layout_policy
    weights, optim = lp.initial
    fmt = FORMAT_OF[lp.name]

    def refused(match: str, **paths) -> None:
        with pytest.raises(CheckpointError, match=match):
            refused_on_driver(lp.layout, lp.cfg, tokenizer, **paths)

    refused(r"weights_path=.*is an optimizer checkpoint.*pass it as optimizer_path", weights_path=optim)
    refused(
        r"optimizer_path=.*is a weights checkpoint.*pass it as weights_path",
        weights_path=weights,
        optimizer_path=weights,
    )
    for other in sorted(set(FORMATS) - {fmt}):  # the other backend's format
        refused(
            f"holds a '{other}' checkpoint; this policy's backend reads '{fmt}'",
            weights_path=foreign_checkpoints(other, MODEL_OF[lp.name]),
        )
    # Weights and optimizer of different saves (each pair on its own is fine).
    lp.policy.save_checkpoint(str(tmp_path / "w2"), str(tmp_path / "o2"))
    refused("different saves", weights_path=weights, optimizer_path=tmp_path / "o2")
    # A file the backend's optimizer checkpoint needs besides the shards (DCP: the scheduler).
    for required in backend_spec(lp.cfg["backend"]).optimizer_files:
        shutil.copytree(optim, tmp_path / f"no_{required}")
        (tmp_path / f"no_{required}" / required).unlink()
        refused(f"{required}.*missing", weights_path=weights, optimizer_path=tmp_path / f"no_{required}")


@pytest.mark.parametrize("layout", layout_params(slow=set(LAYOUTS)), indirect=True)
def test_a_policy_refuses_another_models_checkpoint_in_its_workers(
    layout, policies, foreign_checkpoints, model_dirs, tokenizer
):
    """The workers compare the checkpoint's metadata with the model before reading a shard,
    and name the key."""
    model = MODEL_OF[layout.name]
    other = "llama" if model == "qwen2" else "qwen2"  # q/k/v bias on one side only
    cfg = layout_config(layout, model_dirs[model])
    policies.make_room(layout)
    with pytest.raises(Exception, match=r"q_proj.bias.*in the (checkpoint|model) but not in the (model|checkpoint)"):
        with started_policy(
            layout, cfg, tokenizer, "foreign", weights_path=foreign_checkpoints(FORMAT_OF[layout.name], other)
        ):
            pass


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
def test_another_models_checkpoint_is_refused_naming_the_key(fmt, foreign_checkpoints, model_dirs):
    """What a worker's load does (in this process): refused before any array is read, naming
    the key (and both shapes)."""
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model") as err:
        fmt.load(model_dirs["llama"], foreign_checkpoints(fmt.name, "qwen2"), None)
    assert "does not fit this model" in str(err.value) and "q_proj.bias' (shape (" in str(err.value)
    with pytest.raises(CheckpointError, match="does not fit this model") as err:
        fmt.load(model_dirs["llama"], foreign_checkpoints(fmt.name, "llama_gen"), None)  # hidden 128, not 64
    assert "the model has shape (256, 64), the checkpoint has shape (256, 128)" in str(err.value)
    assert "embed_tokens" in str(err.value)


# ----------------------------------------------------------------------------- atomicity, in process


def _die_in(monkeypatch, owner, name: str, after: int = 0, counts=lambda *args: True):
    """Make ``owner.<name>`` raise a BaseException (a stand-in for SIGKILL: no ``except
    Exception`` swallows it) on its ``after+1``-th call (of those ``counts`` accepts), and
    every call after that."""
    real = getattr(owner, name)
    calls = {"n": 0}

    class Killed(BaseException):
        pass

    def dying(*args, **kwargs):
        calls["n"] += bool(counts(*args))
        if calls["n"] > after:
            raise Killed(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, dying)
    return Killed


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
@pytest.mark.parametrize("where", ["before_manifest", "between_renames"])
def test_interrupted_overwrite_keeps_the_previous_checkpoint(fmt, where, model_dirs, tmp_path, monkeypatch, caplog):
    """A save over an existing checkpoint dies (after every array was written): the previous
    checkpoint still loads, equal to what was saved; a save into a new directory leaves
    nothing that passes for complete."""
    model_dir = model_dirs["qwen2"]
    saved = fmt.state(model_dir, seed=1)
    weights, optim = tmp_path / "weights", tmp_path / "optim"
    fmt.save(saved, weights, optim)

    newer = fmt.state(model_dir, seed=2)
    if where == "before_manifest":  # every array written, the manifest not yet
        killed = _die_in(monkeypatch, pf.mf, "write_manifest")
    else:  # old moved aside, the new one not yet renamed into place (replace #2 = tmp -> final)
        killed = _die_in(monkeypatch, pf.os, "replace", after=1, counts=lambda src, dst: Path(src).is_dir())
    monkeypatch.setattr(pf, "discard_temps", lambda temps: None)  # a killed process cleans nothing up
    with pytest.raises(killed):
        fmt.save(newer, weights, tmp_path / "new_optim", step=9)
    monkeypatch.undo()

    assert not (tmp_path / "new_optim").exists()  # the new directory never appeared
    leftovers = sorted(p for p in tmp_path.iterdir() if p.name.startswith(".tmp-") and p.is_dir())
    assert leftovers, "the killed save's temp dirs should still be there (a kill cleans nothing up)"
    if where == "before_manifest":  # ... and none of them passes for a checkpoint
        for tmp in leftovers:
            with pytest.raises(CheckpointError, match="incomplete checkpoint"):
                pf.check_load_paths(tmp, None, fmt=fmt.name)
    else:
        assert not weights.exists()  # the window: the driver puts the previous one back
        with warns(caplog, "interrupted"):
            pf.check_load_paths(weights, optim, fmt=fmt.name, restore=True)
    loaded, step = fmt.load(model_dir, weights, optim)
    assert step == 3 and _same(fmt, loaded, saved)


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
def test_a_failed_save_cleans_up_and_keeps_the_previous(fmt, model_dirs, tmp_path, monkeypatch):
    model_dir = model_dirs["qwen2"]
    saved = fmt.state(model_dir, seed=1)
    weights, optim = tmp_path / "weights", tmp_path / "optim"
    fmt.save(saved, weights, optim)

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pf.mf, "write_manifest", disk_full)
    with pytest.raises((CheckpointError, OSError), match="disk full"):
        fmt.save(fmt.state(model_dir, seed=2), weights, optim, step=9)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optim", "weights"]  # temps removed
    loaded, step = fmt.load(model_dir, weights, optim)
    assert step == 3 and _same(fmt, loaded, saved)


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
def test_a_save_never_replaces_a_directory_that_is_not_a_checkpoint(fmt, model_dirs, tmp_path):
    state = fmt.state(model_dirs["qwen2"])
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        fmt.save(state, tmp_path / "weights", None)
    with pytest.raises(CheckpointError, match="same directory"):
        fmt.save(state, tmp_path / "w", tmp_path / "w")
    assert (tmp_path / "weights" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
def test_the_workers_size_check_names_a_truncated_file(fmt, model_dirs, tmp_path):
    """``checksums=False`` (what a worker does after the driver's sha256): sizes still checked."""
    model_dir = model_dirs["qwen2"]
    weights, optim = tmp_path / "weights", tmp_path / "optim"
    fmt.save(fmt.state(model_dir), weights, optim)
    target = _biggest_file(weights)
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="truncated") as err:
        fmt.load(model_dir, weights, optim, checksums=False)
    assert target.name in str(err.value) and str(weights) in str(err.value)
