"""Run checkpoints (core.checkpointing): atomic saves, verification, pruning, resume.

The policy's files are stood in for by ``write_policy`` below, which writes numpy arrays in
a small directory tree the way a backend's DCP / orbax writer would; the manager, the
manifest and the RNG capture are the real code under test.
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from core.checkpointing import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
    verify_manifest,
    write_manifest,
)
from core.checkpointing.config import CheckpointingConfig
from core.config import ConfigError
from tests.logs import warns

REPO_ROOT = Path(__file__).resolve().parents[2]
IDENTITY = {"algorithm": "grpo", "backend": "torch_fsdp", "model_name": "tiny-llama", "model_fingerprint": "ab12"}


def write_policy(path: Path, seed: int = 0) -> None:
    """Stand-in for a backend's checkpoint writer: a few arrays in a small tree."""
    rng = np.random.default_rng(seed)
    (path / "model").mkdir(parents=True)
    (path / "optim" / "state").mkdir(parents=True)
    np.save(path / "model" / "layer0.npy", rng.standard_normal((16, 8), dtype=np.float32))
    np.save(path / "optim" / "state" / "exp_avg.npy", rng.standard_normal(128, dtype=np.float32))
    (path / ".metadata").write_bytes(b"dcp-metadata-%d" % seed)


def make(root: Path, identity=IDENTITY, **cfg) -> CheckpointManager:
    return CheckpointManager({"checkpoint_dir": str(root), "save_period": 1, **cfg}, identity=identity)


def save(mgr: CheckpointManager, step: int, metrics=None, **kw) -> Path:
    return mgr.save(
        step,
        lambda p: write_policy(p, seed=step),
        train_state={"step": step, "consumed_samples": 64 * step},
        config={"grpo": {"seed": 1}},
        metrics=metrics if metrics is not None else {"loss": 1.0 / (step + 1)},
        **kw,
    )


def step_names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.name.startswith("step_")}


# ----------------------------------------------------------------------------- basics
def test_import_pulls_in_no_backend():
    code = "import sys, core.checkpointing; print(sorted(m for m in ('jax', 'ray', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_save_load_round_trip(tmp_path):
    mgr = make(tmp_path / "run")
    rng_state = capture_rng_state()
    metrics = {"loss": 0.25, "val/accuracy": float("nan"), "grad_norm": float("inf"), "lr": np.float32(1e-3)}
    train_state = {"step": 7, "data": {"epoch": 1, "position": [3, 5]}, "best": float("nan")}
    config = {"grpo": {"seed": 42, "max_num_steps": 10}, "policy": {"backend": "torch_fsdp", "dims": (1, 2)}}
    path = mgr.save(7, write_policy, train_state=train_state, config=config, metrics=metrics, rng_state=rng_state)

    assert path == tmp_path / "run" / "step_7" and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_7"]
    ck = mgr.load()
    assert (ck.step, ck.path, ck.policy_dir, ck.identity) == (7, path, path / "policy", IDENTITY)
    assert ck.train_state["data"] == {"epoch": 1, "position": [3, 5]} and math.isnan(ck.train_state["best"])
    assert ck.config == {"grpo": {"seed": 42, "max_num_steps": 10}, "policy": {"backend": "torch_fsdp", "dims": [1, 2]}}
    assert ck.metrics["loss"] == 0.25 and math.isnan(ck.metrics["val/accuracy"]) and ck.metrics["grad_norm"] == math.inf
    assert ck.metrics["lr"] == pytest.approx(1e-3)
    json.loads((path / "metrics.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert ck.rng_state["python"] == rng_state["python"] and ck.rng_state["torch"] == rng_state["torch"]
    for saved, loaded in zip(rng_state["numpy"], ck.rng_state["numpy"], strict=True):
        np.testing.assert_array_equal(saved, loaded)
    expected = np.random.default_rng(0).standard_normal((16, 8), dtype=np.float32)  # write_policy seed=0
    np.testing.assert_array_equal(np.load(ck.policy_dir / "model" / "layer0.npy"), expected)

    manifest = json.loads((path / "checkpoint.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["step"]) == ("dualrl-run-checkpoint", 1, 7)
    assert {"policy/.metadata", "policy/optim/state/exp_avg.npy", "train_state.json", "rng_state.pkl"} <= set(
        manifest["files"]
    )
    assert manifest["files"]["policy/.metadata"] == {
        "size": len(b"dcp-metadata-0"),
        "sha256": __import__("hashlib").sha256(b"dcp-metadata-0").hexdigest(),
    }


def test_save_without_rng_state_loads_empty_rng(tmp_path):
    mgr = make(tmp_path)
    save(mgr, 3)
    assert mgr.load().rng_state == {} and not (tmp_path / "step_3" / "rng_state.pkl").exists()


def test_should_save_schedule(tmp_path):
    mgr = make(tmp_path, save_period=3)
    assert [s for s in range(11) if mgr.should_save(s)] == [3, 6, 9]
    assert mgr.should_save(10, last_step=True) and mgr.should_save(0, last_step=True)
    off = make(tmp_path, save_period=3, enabled=False)
    assert not any(off.should_save(s, last_step=True) for s in range(7))
    with pytest.raises(CheckpointError, match="checkpointing.enabled is false"):
        save(off, 3)


def test_config_errors_name_the_dotted_key(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match=r"checkpointing\.checkpoint_dir: .*afile exists and is not a directory"):
        make(tmp_path / "afile")
    # Settings are the typed section's: a ConfigError (exit code 2 in the CLI, like a CheckpointError).
    with pytest.raises(ConfigError) as e:
        make(tmp_path, save_period=0, keep_top_k=0, resume="yes", save_perod=3)
    assert sorted(e.value.errors) == sorted(
        [
            "checkpointing.keep_top_k: must be >= 1, got 0",
            "checkpointing.resume: expected bool, got str ('yes')",
            "checkpointing.save_perod: unknown key (did you mean 'save_period'?)",
            "checkpointing.save_period: must be >= 1, got 0",
        ]
    )
    with pytest.raises(ConfigError, match=r"checkpointing\.save_period: expected int, got bool \(True\)"):
        make(tmp_path, save_period=True)
    with pytest.raises(ConfigError, match=r"checkpointing\.checkpoint_dir: required when enabled or resume is true"):
        CheckpointManager({"enabled": True}, identity=IDENTITY)
    with pytest.raises(ConfigError, match=r"checkpointing\.checkpoint_dir: required when enabled or resume is true"):
        CheckpointManager({"enabled": False, "resume": True}, identity=IDENTITY)
    assert CheckpointManager({"enabled": False}, identity=IDENTITY).checkpoint_dir is None
    typed = CheckpointingConfig(checkpoint_dir=str(tmp_path / "typed"), keep_top_k=2)  # the section itself
    mgr = CheckpointManager(typed, identity=IDENTITY)
    assert (mgr.checkpoint_dir, mgr.keep_top_k, mgr.save_period) == (tmp_path / "typed", 2, 10)
    with pytest.raises(CheckpointError, match="not JSON-serializable"):
        make(tmp_path, identity={"backend": object()})


def test_unserializable_train_state_fails_before_writing(tmp_path):
    mgr = make(tmp_path)
    calls = []
    with pytest.raises(CheckpointError, match=r"step 4.*train_state\.json.*object"):
        mgr.save(4, calls.append, train_state={"it": object()}, config={}, metrics={})
    assert calls == [] and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- pruning
def test_keep_top_k_by_recency_leaves_foreign_files(tmp_path):
    mgr = make(tmp_path, keep_top_k=2)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events").write_text("e")
    (tmp_path / "step_0").mkdir()  # partial (no manifest): not ours to delete
    (tmp_path / "step_01").mkdir()  # not a name we write
    for step in range(1, 6):
        save(mgr, step)
    assert step_names(tmp_path) == {"step_0", "step_01", "step_4", "step_5"}
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "tensorboard" / "events").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "higher_is_better, kept, kept_after_nan",
    [
        (True, {"step_1", "step_2", "step_5"}, {"step_1", "step_2", "step_6"}),
        (False, {"step_3", "step_5"}, {"step_3", "step_5", "step_6"}),
    ],
)
def test_keep_top_k_by_metric_always_keeps_newest(tmp_path, higher_is_better, kept, kept_after_nan):
    mgr = make(tmp_path, keep_top_k=2, metric_name="val/score", higher_is_better=higher_is_better)
    scores = {1: 0.5, 2: 0.9, 3: 0.1, 4: None, 5: 0.3, 6: float("nan")}
    for step in range(1, 6):
        save(mgr, step, metrics={} if scores[step] is None else {"val/score": scores[step]})
    assert step_names(tmp_path) == kept
    # a checkpoint without the metric (step 4) / with nan counts as worst, but the newest one stays
    save(mgr, 6, metrics={"val/score": scores[6]})
    assert step_names(tmp_path) == kept_after_nan


def test_saving_an_older_step_keeps_it_and_the_newest(tmp_path):
    mgr = make(tmp_path, keep_top_k=1, metric_name="val/score")
    save(mgr, 9, metrics={"val/score": 0.5})
    save(mgr, 3, metrics={"val/score": 0.9})  # best, but not the newest: both stay
    assert step_names(tmp_path) == {"step_3", "step_9"}
    path = save(mgr, 4, metrics={"val/score": 0.1})  # neither best nor newest, but just saved
    assert path.is_dir() and step_names(tmp_path) == {"step_3", "step_4", "step_9"}


# ----------------------------------------------------------------------------- failures and crashes
def test_failing_write_policy_leaves_previous_checkpoint(tmp_path):
    mgr = make(tmp_path)
    save(mgr, 10)

    def broken(path):
        write_policy(path)
        raise OSError("disk full")

    with pytest.raises(CheckpointError, match=r"step 20.*disk full") as e:
        mgr.save(20, broken, train_state={}, config={}, metrics={})
    assert isinstance(e.value.__cause__, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10"]
    assert mgr.load().step == 10
    with pytest.raises(CheckpointError, match=r"step 30.*write_policy created nothing"):
        mgr.save(30, lambda p: None, train_state={}, config={}, metrics={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10"]


def test_crash_leftovers_are_skipped_and_cleaned(tmp_path, caplog):
    mgr = make(tmp_path)
    save(mgr, 20)
    tmp = tmp_path / ".tmp-step_30-0badf00d"
    write_policy(tmp / "policy")
    write_policy(tmp_path / "step_40" / "policy")  # a step dir whose manifest never came
    with warns(caplog, r"step_40.*partial checkpoint.*no checkpoint\.json"):
        assert mgr.latest_complete() == tmp_path / "step_20"
    assert mgr.cleanup_stale_temp_dirs() == [tmp]
    assert not tmp.exists() and (tmp_path / "step_40").exists() and (tmp_path / "step_20").exists()


def test_interrupted_resave_is_restored_by_cleanup(tmp_path, caplog):
    mgr = make(tmp_path)
    save(mgr, 10)
    # died between "step_10 -> .old-step_10-*" and ".tmp-* -> step_10"
    os.replace(tmp_path / "step_10", tmp_path / ".old-step_10-12345678")
    with warns(caplog, "restored"):
        assert mgr.cleanup_stale_temp_dirs() == []
    assert mgr.load().step == 10
    # died after the second rename: the old copy is just removed
    os.mkdir(tmp_path / ".old-step_10-87654321")
    assert mgr.cleanup_stale_temp_dirs() == [tmp_path / ".old-step_10-87654321"]


def test_resaving_a_step_replaces_it(tmp_path):
    mgr = make(tmp_path)
    save(mgr, 10, metrics={"loss": 1.0})
    save(mgr, 10, metrics={"loss": 2.0})
    assert mgr.load().metrics == {"loss": 2.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10"]


def test_resave_failing_at_the_final_rename_keeps_the_old_one(tmp_path, monkeypatch):
    mgr = make(tmp_path)
    save(mgr, 10, metrics={"loss": 1.0})
    real_replace = os.replace

    def replace(src, dst):  # the OS refusing the second rename (e.g. EIO, quota)
        if Path(src).name.startswith(".tmp-step_10-"):
            raise OSError("injected rename failure")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointError, match="step 10.*injected rename failure"):
        save(mgr, 10, metrics={"loss": 2.0})
    monkeypatch.undo()
    assert mgr.load().metrics == {"loss": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10"]


def test_truncated_file_is_reported_with_sizes(tmp_path, caplog):
    mgr = make(tmp_path)
    save(mgr, 10)
    path = save(mgr, 20)
    shard = path / "policy" / "model" / "layer0.npy"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"step_20.*'policy/model/layer0.npy'.*expected {size} bytes, found 100"):
        mgr.load(path)
    with warns(caplog, "step_20"):
        assert mgr.latest_complete() == tmp_path / "step_10"


def test_flipped_byte_is_a_checksum_error(tmp_path):
    path = save(make(tmp_path), 10)
    shard = path / "policy" / "optim" / "state" / "exp_avg.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify_manifest(path, checksums=False)["step"] == 10  # same size: the cheap check passes
    with pytest.raises(CheckpointError, match=r"'policy/optim/state/exp_avg.npy' is corrupt: sha256"):
        make(tmp_path).load()


def test_manifest_header_problems(tmp_path):
    step_dir = tmp_path / "step_5"
    write_policy(step_dir / "policy")
    with pytest.raises(CheckpointError, match=r"partial checkpoint: .*step_5 has no checkpoint\.json"):
        verify_manifest(step_dir)
    manifest = write_manifest(step_dir, 5, IDENTITY)
    (step_dir / "extra.txt").write_text("extra files are ignored")
    assert verify_manifest(step_dir) == manifest
    for broken, needle in [
        ("{not json", "unreadable"),
        (json.dumps({**manifest, "format": "orbax"}), "format 'orbax'"),
        (json.dumps({**manifest, "version": 2}), "version 2"),
        (json.dumps({**manifest, "step": 6}), "says step 6, the directory says 5"),
    ]:
        (step_dir / "checkpoint.json").write_text(broken)
        with pytest.raises(CheckpointError, match=needle):
            verify_manifest(step_dir)
    (step_dir / "checkpoint.json").write_text(json.dumps(manifest))
    (step_dir / "policy" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"'policy/.metadata' listed in checkpoint.json is missing"):
        verify_manifest(step_dir)


def test_identity_mismatch_names_key_and_values(tmp_path):
    save(make(tmp_path, identity={**IDENTITY, "backend": "jax_pjit"}), 20)
    with pytest.raises(CheckpointError) as e:
        make(tmp_path).load()
    assert f"checkpoint {tmp_path / 'step_20'} was written by backend 'jax_pjit'; this run uses 'torch_fsdp'" in str(
        e.value
    )
    with pytest.raises(CheckpointError, match=r"model_fingerprint 'ab12'; this run uses 'cd34'"):
        make(tmp_path, identity={**IDENTITY, "backend": "jax_pjit", "model_fingerprint": "cd34"}).load()


# ----------------------------------------------------------------------------- resume
def test_resume_errors_without_a_complete_checkpoint(tmp_path, caplog):
    assert make(tmp_path / "run").resume_point() is None  # resume: false
    with pytest.raises(CheckpointError, match=r"checkpointing\.resume is true but .*run has no complete checkpoint"):
        make(tmp_path / "run", resume=True).resume_point()
    (tmp_path / "run" / "step_5").mkdir(parents=True)
    with warns(caplog), pytest.raises(CheckpointError, match=r"partial checkpoints found:\n  step_5: "):
        make(tmp_path / "run", resume=True).resume_point()


def test_resume_loads_latest_and_cleans_temp_dirs(tmp_path):
    save(make(tmp_path), 10)
    save(make(tmp_path), 20)
    (tmp_path / ".tmp-step_30-aaaaaaaa").mkdir()
    ck = make(tmp_path, resume=True).resume_point()
    assert ck.step == 20 and ck.train_state == {"step": 20, "consumed_samples": 1280}
    assert step_names(tmp_path) == {"step_10", "step_20"} and not (tmp_path / ".tmp-step_30-aaaaaaaa").exists()


# ----------------------------------------------------------------------------- RNG
def _draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_rng_restore_reproduces_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    path = make(tmp_path).save(1, write_policy, train_state={}, config={}, metrics={}, rng_state=capture_rng_state())
    expected = _draws()
    _draws()  # move every generator on
    restore_rng_state(make(tmp_path).load(path).rng_state)
    assert _draws() == expected
    with pytest.raises(CheckpointError, match=r"missing \['torch'\]"):
        restore_rng_state({"python": random.getstate(), "numpy": np.random.get_state()})


# ----------------------------------------------------------------------------- a real kill
_CHILD = """
import json, sys, time
from pathlib import Path
from core.checkpointing import CheckpointManager
root, marker, step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
def write_policy(path):
    path.mkdir()
    (path / "shard0.bin").write_bytes(b"x" * 65536)
    marker.write_text("writing")
    time.sleep(60)
mgr = CheckpointManager({"checkpoint_dir": root, "save_period": 1}, identity=json.loads(sys.argv[4]))
mgr.save(step, write_policy, train_state={"step": step}, config={}, metrics={})
"""


@pytest.mark.parametrize("killed_step", [20, 10], ids=["new-step", "resave-same-step"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, killed_step):
    root, marker = tmp_path / "run", tmp_path / "marker"
    save(make(root), 10)
    args = [sys.executable, "-c", _CHILD, str(root), str(marker), str(killed_step), json.dumps(IDENTITY)]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), f"child never reached write_policy: {proc.stderr.read() if proc.poll() is not None else ''}"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    proc.stderr.close()

    leftovers = [p for p in root.iterdir() if p.name.startswith(f".tmp-step_{killed_step}-")]
    assert len(leftovers) == 1 and (leftovers[0] / "policy" / "shard0.bin").exists()
    mgr = make(root)
    assert mgr.latest_complete() == root / "step_10"
    ck = mgr.load()
    assert ck.step == 10 and ck.train_state["step"] == 10
    assert mgr.cleanup_stale_temp_dirs() == leftovers and sorted(p.name for p in root.iterdir()) == ["step_10"]
