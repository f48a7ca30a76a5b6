"""Policy checkpoints you can trust (torch DCP): atomic saves, verified loads, clear refusals.

The fast tests drive ``backends.torch_common.checkpoint`` in this process (a single
process: DCP needs no process group) on the tiny HF models; the ``slow`` ones run an FSDP1
dp=2 policy through Ray, kill rank 0 in the middle of a save and check, on the driver and
in the workers, what is left.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.torch_common import checkpoint as ckpt
from core.checkpointing import policy_files as pf
from core.checkpointing.manifest import MANIFEST_NAME, CheckpointError
from core.testing.tiny_models import random_batch, save_tiny_model
from tests.torch_backends.conftest import SEQ, VOCAB


# ----------------------------------------------------------------------------- helpers
def _model(model_dir: Path, seed: int = 0):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    with torch.no_grad():  # distinct weights per seed: a stale load cannot pass for a fresh one
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _save(model, optimizer, root: Path, step: int = 3) -> tuple[Path, Path]:
    weights, optim = root / "weights", root / "optim"
    ckpt.save_dcp(model, weights, optimizer, optim, {"train_step": step}, train_step=step)
    return weights, optim


def _logprobs(model) -> torch.Tensor:
    ids, _ = random_batch(3, SEQ, VOCAB, seed=7)
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.double(), -1)


def _shard(path: Path) -> Path:
    """The largest DCP shard file (one per rank that wrote data)."""
    return max(path.glob("*.distcp"), key=lambda p: (p.stat().st_size, p.name))


def _fresh_load(model_dir: Path, weights: Path, optim: Path | None = None, **kw):
    model, optimizer = _model(model_dir, seed=99)
    extra = ckpt.load_dcp(model, weights, optimizer, optim, **kw)
    return model, extra


# ----------------------------------------------------------------------------- corruption
def test_round_trip_and_manifest(model_dirs, tmp_path):
    model, optimizer = _model(model_dirs["llama"])
    weights, optim = _save(model, optimizer, tmp_path)
    for path, kind in ((weights, pf.KIND_WEIGHTS), (optim, pf.KIND_OPTIMIZER)):
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        assert manifest["identity"]["kind"] == kind and manifest["identity"]["format"] == "torch-dcp"
        assert ".metadata" in manifest["files"] and manifest["step"] == 3
    assert ckpt.SCHEDULER_FILE in json.loads((optim / MANIFEST_NAME).read_text())["files"]
    loaded, extra = _fresh_load(model_dirs["llama"], weights, optim)
    assert extra == {"train_step": 3}
    torch.testing.assert_close(_logprobs(loaded), _logprobs(model), rtol=0, atol=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp / old left


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_shard_is_named(damage, model_dirs, tmp_path):
    model, optimizer = _model(model_dirs["llama"])
    weights, optim = _save(model, optimizer, tmp_path)
    shard = _shard(weights)
    size = shard.stat().st_size
    assert size > 3 * 4096
    if damage == "corrupt":  # 4 KiB overwritten in the middle: same size, different bytes
        with open(shard, "r+b") as f:
            f.seek(size // 2)
            f.write(os.urandom(4096))
        expected = "is corrupt: sha256"
    else:
        with open(shard, "r+b") as f:
            f.truncate(size - 4096)
        expected = "truncated"
    for checksums in (True, False):  # the driver checks sha256; a worker after it sizes only
        if damage == "corrupt" and not checksums:
            continue
        with pytest.raises(CheckpointError, match=expected) as err:
            _fresh_load(model_dirs["llama"], weights, optim, checksums=checksums)
        assert shard.name in str(err.value) and str(weights) in str(err.value)
        # ... and the driver says the same before any worker starts
        with pytest.raises(CheckpointError, match=expected):
            pf.check_load_paths(weights, optim, fmt=ckpt.FORMAT, checksums=checksums)


def test_missing_manifest_is_an_incomplete_checkpoint(model_dirs, tmp_path):
    model, optimizer = _model(model_dirs["llama"])
    weights, optim = _save(model, optimizer, tmp_path)
    (weights / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint: weights_path=.*has no checkpoint\.json"):
        _fresh_load(model_dirs["llama"], weights, optim)


# ----------------------------------------------------------------------------- interrupted saves
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


@pytest.mark.parametrize("where", ["before_manifest", "between_renames"])
def test_interrupted_overwrite_keeps_the_previous_checkpoint(where, model_dirs, tmp_path, monkeypatch):
    """A save over an existing checkpoint dies (after every shard was written): the previous
    checkpoint still loads, equal to what was saved; a save into a new directory leaves
    nothing that passes for complete."""
    model, optimizer = _model(model_dirs["llama"], seed=1)
    weights, optim = _save(model, optimizer, tmp_path)
    saved_lp = _logprobs(model)

    newer, newer_opt = _model(model_dirs["llama"], seed=2)
    if where == "before_manifest":  # every shard written, the manifest not yet
        killed = _die_in(monkeypatch, pf.mf, "write_manifest")
    else:  # old moved aside, the new one not yet renamed into place (replace #2 = tmp -> final)
        killed = _die_in(monkeypatch, pf.os, "replace", after=1, counts=lambda src, dst: Path(src).is_dir())
    monkeypatch.setattr(pf, "discard_temps", lambda temps: None)  # a killed process cleans nothing up
    with pytest.raises(killed):
        ckpt.save_dcp(newer, weights, newer_opt, tmp_path / "new_optim", {"train_step": 9}, train_step=9)
    monkeypatch.undo()

    assert not (tmp_path / "new_optim").exists()  # the new directory never appeared
    leftovers = sorted(p for p in tmp_path.iterdir() if p.name.startswith(".tmp-"))
    assert leftovers, "the killed save's temp dirs should still be there (a kill cleans nothing up)"
    if where == "before_manifest":  # ... and none of them passes for a checkpoint
        for tmp in leftovers:
            with pytest.raises(CheckpointError, match="incomplete checkpoint"):
                pf.check_load_paths(tmp, None, fmt=ckpt.FORMAT)
    if where == "between_renames":
        assert not weights.exists()  # the window: the driver puts the previous one back
        with pytest.warns(UserWarning, match="interrupted"):
            pf.check_load_paths(weights, optim, fmt=ckpt.FORMAT, restore=True)
    loaded, extra = _fresh_load(model_dirs["llama"], weights, optim)
    assert extra == {"train_step": 3}
    torch.testing.assert_close(_logprobs(loaded), saved_lp, rtol=0, atol=0)


def test_failed_save_cleans_up_and_keeps_the_previous(model_dirs, tmp_path, monkeypatch):
    model, optimizer = _model(model_dirs["llama"], seed=1)
    weights, optim = _save(model, optimizer, tmp_path)
    saved_lp = _logprobs(model)

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pf.mf, "write_manifest", disk_full)
    newer, newer_opt = _model(model_dirs["llama"], seed=2)
    with pytest.raises(CheckpointError, match="disk full"):
        ckpt.save_dcp(newer, weights, newer_opt, optim, {"train_step": 9}, train_step=9)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optim", "weights"]  # temps removed
    loaded, _ = _fresh_load(model_dirs["llama"], weights, optim)
    torch.testing.assert_close(_logprobs(loaded), saved_lp, rtol=0, atol=0)


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(model_dirs, tmp_path):
    model, optimizer = _model(model_dirs["llama"])
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        ckpt.save_dcp(model, tmp_path / "weights")
    with pytest.raises(CheckpointError, match="same directory"):
        ckpt.save_dcp(model, tmp_path / "w", optimizer, tmp_path / "w")
    assert (tmp_path / "weights" / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- wrong checkpoints
def test_checkpoint_of_another_architecture_names_key_and_shapes(model_dirs, tmp_path):
    qwen, _ = _model(model_dirs["qwen2"])
    ckpt.save_dcp(qwen, tmp_path / "qwen2")
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model") as err:
        _fresh_load(model_dirs["llama"], tmp_path / "qwen2")
    assert "model.layers.0.self_attn.q_proj.bias" in str(err.value) and "(64,)" in str(err.value)

    wide_dir = save_tiny_model("llama_gen", tmp_path / "llama_gen")  # hidden 128 instead of 64
    wide, _ = _model(wide_dir)
    ckpt.save_dcp(wide, tmp_path / "wide")
    with pytest.raises(CheckpointError) as err:
        _fresh_load(model_dirs["llama"], tmp_path / "wide")
    msg = str(err.value)
    assert "key 'model.embed_tokens.weight': the model has shape (256, 64), the checkpoint has shape (256, 128)" in msg
    assert "does not fit this model" in msg


def test_weights_and_optimizer_dirs_swapped_are_named(model_dirs, tmp_path):
    model, optimizer = _model(model_dirs["llama"])
    weights, optim = _save(model, optimizer, tmp_path)
    with pytest.raises(
        CheckpointError, match=r"weights_path=.*optim'? is an optimizer checkpoint.*pass it as optimizer_path"
    ):
        _fresh_load(model_dirs["llama"], optim)
    with pytest.raises(CheckpointError, match=r"optimizer_path=.*is a weights checkpoint.*pass it as weights_path"):
        _fresh_load(model_dirs["llama"], weights, weights)


def test_optimizer_without_scheduler_file_is_refused(model_dirs, tmp_path):
    model, optimizer = _model(model_dirs["llama"])
    weights, optim = _save(model, optimizer, tmp_path)
    (optim / ckpt.SCHEDULER_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"scheduler_and_step\.pt.*missing"):
        _fresh_load(model_dirs["llama"], weights, optim)
    # Also when the manifest does not even list it (written without one): refused, not half-loaded.
    manifest = json.loads((optim / MANIFEST_NAME).read_text())
    manifest["files"].pop(ckpt.SCHEDULER_FILE)
    (optim / MANIFEST_NAME).write_text(json.dumps(manifest))
    model2, optimizer2 = _model(model_dirs["llama"], seed=5)
    before = _logprobs(model2)
    with pytest.raises(CheckpointError, match=r"has no scheduler_and_step\.pt.*refusing"):
        ckpt.load_dcp(model2, weights, optimizer2, optim)
    torch.testing.assert_close(_logprobs(model2), before, rtol=0, atol=0)  # nothing was loaded


def test_weights_and_optimizer_of_different_saves_are_refused(model_dirs, tmp_path):
    model, optimizer = _model(model_dirs["llama"])
    weights, _ = _save(model, optimizer, tmp_path / "a")
    _, optim_b = _save(model, optimizer, tmp_path / "b")
    with pytest.raises(CheckpointError, match="different saves"):
        _fresh_load(model_dirs["llama"], weights, optim_b)


# ----------------------------------------------------------------------------- through the Policy (Ray, FSDP1 dp=2)
def _kill_rank0_in(policy, target: str) -> None:
    """In every worker process, replace ``backends.torch_common.checkpoint.pf.<target>`` so
    that rank 0 dies (``os._exit``: no cleanup, like SIGKILL) when it gets there."""
    import ray

    def patch(worker, target=target):
        from backends.torch_common import checkpoint as wckpt

        def die(*args, **kwargs):
            if worker.rank == 0:
                os._exit(1)

        setattr(wckpt.pf, target, die)

    ray.get([w.__ray_call__.remote(patch) for w in policy.worker_group.workers])


@pytest.mark.slow
def test_policy_save_killed_on_rank0_keeps_the_previous_checkpoint(ray_session, model_dirs, tokenizer, tmp_path):
    from core.data import BatchedDataDict
    from core.distributed import RayVirtualCluster
    from core.losses import ClippedPGLossFn
    from core.policy import Policy
    from tests.torch_backends.conftest import pg_batch, policy_config
    from tests.torch_backends.test_torch_policy import PG_CFG

    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    probe = BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(4, SEQ, VOCAB, seed=42), strict=True))
    weights, optim = tmp_path / "weights", tmp_path / "optim"
    cluster = RayVirtualCluster([2], use_gpus=False)
    try:
        policy = Policy(cluster, cfg, tokenizer)
        policy.train(pg_batch(4, seed=40), ClippedPGLossFn(PG_CFG))
        policy.save_checkpoint(weights, optim)
        saved_lp = policy.get_logprobs(probe)["logprobs"]
        policy.train(pg_batch(4, seed=41), ClippedPGLossFn(PG_CFG))
        # Rank 0 dies after every rank wrote its shards, before any manifest: the save over
        # ``weights`` and the one into the new ``new_optim`` are both cut off.
        _kill_rank0_in(policy, "finish_save")
        with pytest.raises(Exception, match="rank"):
            policy.save_checkpoint(weights, tmp_path / "new_optim")
        policy.shutdown()

        assert not (tmp_path / "new_optim").exists()
        for tmp in (p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")):
            with pytest.raises(CheckpointError, match="incomplete checkpoint"):
                Policy(cluster, cfg, tokenizer, weights_path=tmp)  # refused on the driver

        # Refused on the driver, before any worker starts (no group to kill):
        bad = tmp_path / "bad"
        shutil.copytree(weights, bad)
        with open(_shard(bad), "r+b") as f:
            f.seek(_shard(bad).stat().st_size // 2)
            f.write(os.urandom(4096))
        with pytest.raises(CheckpointError, match=f"{_shard(bad).name}.*is corrupt"):
            Policy(cluster, cfg, tokenizer, weights_path=bad)
        with pytest.raises(CheckpointError, match="is an optimizer checkpoint"):
            Policy(cluster, cfg, tokenizer, weights_path=optim)

        resumed = Policy(cluster, cfg, tokenizer, weights_path=weights, optimizer_path=optim)
        try:
            torch.testing.assert_close(resumed.get_logprobs(probe)["logprobs"], saved_lp, rtol=0, atol=0)
        finally:
            resumed.shutdown()
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_policy_refuses_another_architecture_in_the_workers(ray_session, model_dirs, tokenizer, tmp_path):
    """A qwen2 checkpoint into a llama policy: the workers compare the DCP metadata with
    the model before reading a shard and name the key."""
    from core.distributed import RayVirtualCluster
    from core.policy import Policy
    from tests.torch_backends.conftest import policy_config

    qwen, _ = _model(model_dirs["qwen2"])
    ckpt.save_dcp(qwen, tmp_path / "qwen2")
    cluster = RayVirtualCluster([2], use_gpus=False)
    try:
        with pytest.raises(Exception, match=r"q_proj\.bias.*in the checkpoint but not in the model"):
            Policy(
                cluster, policy_config(model_dirs["llama"], "torch_fsdp"), tokenizer, weights_path=tmp_path / "qwen2"
            )
    finally:
        cluster.shutdown()
