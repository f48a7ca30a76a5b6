"""Torch DCP specifics of trustworthy checkpoints (the format-independent atomicity and refusals,
and the Policy-level round trip on every layout: tests/backends/test_checkpoint_trust.py).

In this process (DCP needs no process group): the scheduler / step file an optimizer
checkpoint must hold, and that saving an optimizer that has not stepped yet leaves training
unchanged.  The ``slow`` one runs an FSDP1 dp=2 policy through Ray, kills rank 0 in the middle
of a save and checks, on the driver and in the workers, what is left.
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
from core.checkpointing.manifest import MANIFEST_NAME, CheckpointError
from core.testing.tiny_models import random_batch
from tests.torch_backends.conftest import SEQ, VOCAB


# ----------------------------------------------------------------------------- helpers
def perturbed_model(model_dir: Path, seed: int = 0):
    """(model, AdamW) with the model's weights moved by a seeded perturbation: distinct weights
    per seed, so a stale load cannot pass for a fresh one."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
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
    model, optimizer = perturbed_model(model_dir, seed=99)
    extra = ckpt.load_dcp(model, weights, optimizer, optim, **kw)
    return model, extra


def test_optimizer_without_scheduler_file_is_refused(model_dirs, tmp_path):
    model, optimizer = perturbed_model(model_dirs["llama"])
    weights, optim = _save(model, optimizer, tmp_path)
    assert ckpt.SCHEDULER_FILE in json.loads((optim / MANIFEST_NAME).read_text())["files"]
    (optim / ckpt.SCHEDULER_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"scheduler_and_step\.pt.*missing"):
        _fresh_load(model_dirs["llama"], weights, optim)
    # Also when the manifest does not even list it (written without one): refused, not half-loaded.
    manifest = json.loads((optim / MANIFEST_NAME).read_text())
    manifest["files"].pop(ckpt.SCHEDULER_FILE)
    (optim / MANIFEST_NAME).write_text(json.dumps(manifest))
    model2, optimizer2 = perturbed_model(model_dirs["llama"], seed=5)
    before = _logprobs(model2)
    with pytest.raises(CheckpointError, match=r"has no scheduler_and_step\.pt.*refusing"):
        ckpt.load_dcp(model2, weights, optimizer2, optim)
    torch.testing.assert_close(_logprobs(model2), before, rtol=0, atol=0)  # nothing was loaded


def test_saving_before_the_first_step_does_not_change_training(model_dirs, tmp_path):
    """torch's DCP state-dict helper materialises a fresh optimizer's state with an lr=0 step
    (AdamW step 1): the save must not leave that behind, and its checkpoint must load as a
    fresh optimizer (step 0), or a run that saved at step 0 trains differently."""
    ids = torch.randint(4, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))

    def two_steps(model, optimizer):
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    def fresh():
        model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    expected = two_steps(*fresh())
    saved = fresh()
    weights, optim = _save(*saved, tmp_path, step=0)
    assert two_steps(*saved) == expected
    loaded = fresh()
    ckpt.load_dcp(loaded[0], weights, loaded[1], optim)
    assert two_steps(*loaded) == expected


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
    from tests.hf_reference import PG_CFG
    from tests.torch_backends.conftest import pg_batch, policy_config

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
