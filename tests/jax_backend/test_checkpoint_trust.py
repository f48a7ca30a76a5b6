"""Policy checkpoints you can trust (JAX / orbax): atomic saves, verified loads, clear refusals.

Drives ``backends.jax_pjit.checkpoint`` in this process on the params of the tiny HF
models (what ``JaxPolicyWorker.save_checkpoint`` / ``load_checkpoint`` call).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from backends.jax_pjit import checkpoint as jckpt  # noqa: E402
from core.checkpointing import policy_files as pf  # noqa: E402
from core.checkpointing.manifest import MANIFEST_NAME, CheckpointError  # noqa: E402


def _state(model_dir: Path, seed: int = 0):
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
    opt_state = optax.adamw(1e-2).init(params)
    return params, opt_state


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True))


@pytest.fixture(scope="module")
def saved(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("jax_ckpt")
    params, opt_state = _state(model_dirs["qwen2"], seed=1)
    jckpt.save_orbax(params, opt_state, 3, root / "w", root / "o")
    return root, params, opt_state


def _copy(saved, tmp_path) -> tuple[Path, Path]:
    import shutil

    root = saved[0]
    shutil.copytree(root / "w", tmp_path / "w")
    shutil.copytree(root / "o", tmp_path / "o")
    return tmp_path / "w", tmp_path / "o"


def _biggest_file(path: Path) -> Path:
    return max((p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST_NAME), key=lambda p: p.stat().st_size)


def test_round_trip(saved, model_dirs):
    root, params, opt_state = saved
    manifest = json.loads((root / "o" / MANIFEST_NAME).read_text())
    assert manifest["identity"]["kind"] == pf.KIND_OPTIMIZER and manifest["identity"]["format"] == "orbax"
    fresh, fresh_opt = _state(model_dirs["qwen2"], seed=9)
    got, got_opt, step = jckpt.load_orbax(fresh, fresh_opt, root / "w", root / "o")
    assert step == 3 and _same(got, params) and _same(got_opt, opt_state)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "no_manifest"])
def test_damaged_checkpoint_is_named(damage, saved, model_dirs, tmp_path):
    weights, optim = _copy(saved, tmp_path)
    target = _biggest_file(weights)
    size = target.stat().st_size
    if damage == "corrupt":
        with open(target, "r+b") as f:
            f.seek(size // 2)
            f.write(os.urandom(min(4096, size // 2)))
        match = "is corrupt: sha256"
    elif damage == "truncate":
        with open(target, "r+b") as f:
            f.truncate(size // 2)
        match = "truncated"
    else:
        (weights / MANIFEST_NAME).unlink()
        match = "incomplete checkpoint"
    fresh, fresh_opt = _state(model_dirs["qwen2"], seed=9)
    with pytest.raises(CheckpointError, match=match) as err:
        jckpt.load_orbax(fresh, fresh_opt, weights, optim)
    assert str(weights) in str(err.value)
    if damage != "no_manifest":
        assert target.name in str(err.value)


def test_interrupted_overwrite_keeps_the_previous_checkpoint(saved, model_dirs, tmp_path, monkeypatch):
    weights, optim = _copy(saved, tmp_path)
    _, params, opt_state = saved
    newer, newer_opt = _state(model_dirs["qwen2"], seed=2)

    class Killed(BaseException):
        pass

    def killed(*args, **kwargs):
        raise Killed()

    monkeypatch.setattr(pf.mf, "write_manifest", killed)  # every array written, no manifest yet
    monkeypatch.setattr(pf, "discard_temps", lambda temps: None)  # a killed process cleans nothing up
    with pytest.raises(Killed):
        jckpt.save_orbax(newer, newer_opt, 9, weights, tmp_path / "new_o")
    monkeypatch.undo()
    assert not (tmp_path / "new_o").exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-") and p.is_dir()]
    assert leftovers
    for tmp in leftovers:
        with pytest.raises(CheckpointError, match="incomplete checkpoint"):
            pf.check_load_paths(tmp, None, fmt=jckpt.FORMAT)
    fresh, fresh_opt = _state(model_dirs["qwen2"], seed=9)
    got, got_opt, step = jckpt.load_orbax(fresh, fresh_opt, weights, optim)
    assert step == 3 and _same(got, params) and _same(got_opt, opt_state)


def test_wrong_checkpoints_are_named(saved, model_dirs, tmp_path):
    root = saved[0]
    llama, llama_opt = _state(model_dirs["llama"], seed=9)
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model") as err:
        jckpt.load_orbax(llama, llama_opt, root / "w", None)  # qwen2 weights into llama
    assert "q_proj.bias" in str(err.value)

    from core.testing.tiny_models import save_tiny_model

    wide, wide_opt = _state(save_tiny_model("llama_gen", tmp_path / "llama_gen"))
    jckpt.save_orbax(wide, wide_opt, 0, tmp_path / "wide", None)
    with pytest.raises(CheckpointError) as err:
        jckpt.load_orbax(llama, llama_opt, tmp_path / "wide", None)
    assert "the model has shape (256, 64), the checkpoint has shape (256, 128)" in str(err.value)
    assert "embed_tokens.embedding" in str(err.value)

    qwen, qwen_opt = _state(model_dirs["qwen2"], seed=9)
    with pytest.raises(CheckpointError, match="is an optimizer checkpoint.*pass it as optimizer_path"):
        jckpt.load_orbax(qwen, qwen_opt, root / "o", None)
    with pytest.raises(CheckpointError, match="holds a 'orbax' checkpoint; this policy's backend reads 'torch-dcp'"):
        pf.check_load_paths(root / "w", None, fmt="torch-dcp")
