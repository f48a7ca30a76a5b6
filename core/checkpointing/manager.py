"""CheckpointManager: atomic run checkpoints (``step_N/``), pruning, resume.

The directory layout is described in ``core/checkpointing/__init__.py``.

Everything is first written into a ``.tmp-*`` directory and made visible by one rename,
so a crash at any moment leaves the previous checkpoints intact and never a ``step_N``
that passes for complete when it is not.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import core.checkpointing.manifest as mf
from core.checkpointing.config import CheckpointingConfig
from core.checkpointing.manifest import CheckpointError
from core.checkpointing.rng import load_rng_state, save_rng_state
from core.reporting import get_logger

logger = get_logger(__name__)

__all__ = ["CheckpointManager", "LoadedCheckpoint", "read_checkpoint"]

_TMP_RE = re.compile(r"\.(tmp|trash)-step_[0-9]+-[0-9a-f]{8}")
_OLD_RE = re.compile(r"\.old-step_([0-9]+)-[0-9a-f]{8}")
_MISSING = object()


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint, read back; the policy's files stay on disk under ``policy_dir``."""

    step: int
    path: Path
    policy_dir: Path
    train_state: dict[str, Any]
    rng_state: dict[str, Any]  # {} when the save was given no rng_state
    config: dict[str, Any]
    metrics: dict[str, Any]
    identity: dict[str, Any]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _show(value: Any) -> str:
    return "(not recorded)" if value is _MISSING else repr(value)


def _rmtree_quiet(path: Path) -> None:
    """Best-effort removal (cleanup on a path that already failed must not mask the error)."""
    shutil.rmtree(path, ignore_errors=True)


class CheckpointManager:
    """Saves, prunes, finds and loads the run checkpoints of one run directory.

    ``identity`` is what a resume must match (e.g. algorithm, backend, model name and
    fingerprint); it is stored in every manifest and compared key by key on load.
    """

    def __init__(self, cfg: CheckpointingConfig | Mapping[str, Any], *, identity: Mapping[str, Any]):
        c = CheckpointingConfig.coerce(cfg, "checkpointing")
        self.enabled = c.enabled
        self.checkpoint_dir = c.directory
        if self.checkpoint_dir is not None:
            self._root()  # a checkpoint_dir that is a file fails here, before any worker starts
        self.save_period = c.save_period
        self.keep_top_k = c.keep_top_k
        self.metric_name = c.metric_name
        self.higher_is_better = c.higher_is_better
        self.resume = c.resume
        try:  # normalized through JSON so that it compares equal to what a manifest holds
            self.identity: dict[str, Any] = json.loads(json.dumps(dict(identity), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint identity {identity!r} is not JSON-serializable: {e}") from e

    def _root(self) -> Path:
        """``checkpoint_dir``, re-checked: it may have become a file since __init__."""
        if self.checkpoint_dir is None:
            raise CheckpointError("checkpointing.checkpoint_dir is not set")
        if self.checkpoint_dir.exists() and not self.checkpoint_dir.is_dir():
            raise CheckpointError(f"checkpointing.checkpoint_dir: {self.checkpoint_dir} exists and is not a directory")
        return self.checkpoint_dir

    def should_save(self, step: int, *, last_step: bool = False) -> bool:
        """Every ``save_period`` steps and at the last step.  Step 0 (before any update)
        is not a periodic save point."""
        return self.enabled and (last_step or (step > 0 and step % self.save_period == 0))

    def save(
        self,
        step: int,
        write_policy: Callable[[Path], None],
        *,
        train_state: Mapping,
        config: Mapping,
        metrics: Mapping,
        rng_state: Mapping | None = None,
    ) -> Path:
        """Write checkpoint ``step_<step>`` atomically, then prune; returns its path.

        ``write_policy(path)`` must create the backend's files under ``path`` (it does not
        exist yet: orbax refuses an existing target).  On any failure the temp directory is
        removed and the previous checkpoints are untouched.
        """
        if not self.enabled:
            raise CheckpointError(f"save(step {step}): checkpointing.enabled is false")
        if not _is_int(step) or step < 0:
            raise CheckpointError(f"save: step {step!r} is not an integer >= 0")
        root = self._root()
        tmp = root / f".tmp-step_{step}-{uuid.uuid4().hex[:8]}"
        try:
            texts = mf.serialize_driver_state(step, train_state, config, metrics)
            tmp.mkdir(parents=True)
            write_policy(tmp / mf.POLICY_DIR)
            if not (tmp / mf.POLICY_DIR).exists():
                raise CheckpointError(f"write_policy created nothing at {tmp / mf.POLICY_DIR}")
            for name, text in texts.items():
                (tmp / name).write_text(text, encoding="utf-8")
            if rng_state is not None:
                save_rng_state(tmp / mf.RNG_FILE, rng_state)
            mf.write_manifest(tmp, step, self.identity)  # last: marks the checkpoint complete
            final = self._install(tmp, step)
        except BaseException as e:
            _rmtree_quiet(tmp)
            if isinstance(e, Exception):
                raise CheckpointError(f"saving checkpoint step {step} in {root} failed: {e}") from e
            raise
        self._prune(keep=final)
        return final

    def _install(self, tmp: Path, step: int) -> Path:
        """Rename the finished temp dir to ``step_<step>``, swapping out an existing one."""
        final = tmp.parent / f"step_{step}"
        # The previous step_N is moved aside first (cleanup_stale_temp_dirs puts it back if
        # we die before the next rename).
        old = mf.install_dir(tmp, final, tmp.parent / f".old-step_{step}-{uuid.uuid4().hex[:8]}")
        if old is not None:
            _rmtree_quiet(old)
        return final

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """``step_N`` directories, newest first (anything else in the directory is ignored)."""
        root = self.checkpoint_dir
        if root is None or not root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in root.iterdir() if (m := mf.STEP_DIR_RE.fullmatch(p.name)) and p.is_dir()]
        return sorted(found, reverse=True)

    def _verified(self) -> Iterator[tuple[int, Path, CheckpointError | None]]:
        """(step, path, problem or None) per step dir, newest first, sizes-only checks."""
        for step, path in self._step_dirs():
            try:
                mf.verify_manifest(path, checksums=False)
                yield step, path, None
            except CheckpointError as e:
                yield step, path, e

    def latest_complete(self) -> Path | None:
        """The newest ``step_N`` that verifies (sizes only); skipped ones are warned about."""
        for _, path, problem in self._verified():
            if problem is None:
                return path
            logger.warning("skipping incomplete checkpoint %s: %s", path, problem)
        return None

    def _score(self, path: Path) -> tuple[int, float]:
        """Sort key of a checkpoint by ``metric_name``: bigger is better; missing /
        non-numeric / nan metrics rank below every real value."""
        try:
            value = mf.decode_metrics(mf.read_state_file(path / mf.METRICS_FILE, json.loads)).get(self.metric_name)
        except (CheckpointError, AttributeError):
            return (0, 0.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return (0, 0.0)
        return (1, float(value) if self.higher_is_better else -float(value))

    def _prune(self, keep: Path) -> list[Path]:
        """Delete complete checkpoints beyond ``keep_top_k``; the newest and ``keep`` (the
        one just saved) always stay.  Partial ``step_N`` dirs and foreign files are left."""
        if self.keep_top_k is None:
            return []
        complete = [(s, p) for s, p, problem in self._verified() if problem is None]  # newest first
        if self.metric_name is None:
            best = complete[: self.keep_top_k]
        else:
            best = sorted(complete, key=lambda sp: (self._score(sp[1]), sp[0]), reverse=True)[: self.keep_top_k]
        kept = {p for _, p in best} | {p for _, p in complete[:1]} | {keep}
        removed = []
        for step, path in complete:
            if path in kept:
                continue
            try:  # rename first: a crash mid-delete then leaves no half-deleted step_N
                trash = path.parent / f".trash-step_{step}-{uuid.uuid4().hex[:8]}"
                os.replace(path, trash)
                shutil.rmtree(trash)
                removed.append(path)
            except OSError as e:  # the save itself succeeded: do not fail the run for this
                logger.warning("could not delete old checkpoint %s: %s", path, e)
        return removed

    def load(self, path: Path | str | None = None) -> LoadedCheckpoint:
        """Verify (with checksums) and read a checkpoint; ``None`` = the latest complete.

        Raises :class:`CheckpointError` when it is partial, corrupt, or was written by a
        run with a different identity (naming the key and both values).
        """
        if path is None:
            path = self.latest_complete()
            if path is None:
                raise CheckpointError(f"no complete checkpoint in {self._root()}")
        path = Path(path)
        manifest = mf.verify_manifest(path, checksums=True)
        self._check_identity(path, manifest["identity"])
        return LoadedCheckpoint(
            step=manifest["step"],
            path=path,
            policy_dir=path / mf.POLICY_DIR,
            rng_state=load_rng_state(path / mf.RNG_FILE) if mf.RNG_FILE in manifest["files"] else {},
            identity=manifest["identity"],
            **mf.read_driver_state(path, manifest),
        )

    def _check_identity(self, path: Path, saved: dict[str, Any]) -> None:
        """Every identity key must agree: a resume across backends / models is refused."""
        diffs = []
        for key in sorted(set(saved) | set(self.identity)):
            s, c = saved.get(key, _MISSING), self.identity.get(key, _MISSING)
            if s != c:
                diffs.append(f"checkpoint {path} was written by {key} {_show(s)}; this run uses {_show(c)}")
        if diffs:
            raise CheckpointError("\n".join(diffs))

    def resume_point(self) -> LoadedCheckpoint | None:
        """The checkpoint to resume from when ``checkpointing.resume`` is true, else None.

        Cleans up the leftovers of crashed saves first (this is the start of the run: no
        save of ours is in flight).
        """
        if not self.resume:
            return None
        root = self._root()
        if not root.is_dir():
            raise CheckpointError(
                f"checkpointing.resume is true but {root} has no complete checkpoint (it does not exist)"
            )
        self.cleanup_stale_temp_dirs()
        latest = self.latest_complete()
        if latest is None:
            partial = [f"\n  {p.name}: {problem}" for _, p, problem in self._verified() if problem is not None]
            found = "; partial checkpoints found:" + "".join(partial) if partial else ""
            raise CheckpointError(f"checkpointing.resume is true but {root} has no complete checkpoint{found}")
        return self.load(latest)

    def cleanup_stale_temp_dirs(self) -> list[Path]:
        """Remove the temp / trash dirs crashed saves left; returns the removed paths.

        A ``.old-step_N-*`` dir (a re-save of step N died between its two renames) is put
        back as ``step_N`` when that is missing, and removed otherwise.
        """
        root = self.checkpoint_dir
        if root is None or not root.is_dir():
            return []
        removed: list[Path] = []
        for child in sorted(root.iterdir()):
            if not child.is_dir() or child.is_symlink():
                continue
            old = _OLD_RE.fullmatch(child.name)
            final = root / f"step_{int(old.group(1))}" if old else None
            if final is not None and not final.exists():
                os.replace(child, final)
                logger.warning("restored %s from %s (a re-save was interrupted)", final, child.name)
            elif old or _TMP_RE.fullmatch(child.name):
                shutil.rmtree(child)
                removed.append(child)
        mf.fsync_dir(root)
        return removed


def read_checkpoint(path: Path | str) -> LoadedCheckpoint:
    """A checkpoint read from outside its run (``dualrl eval``): ``path`` is a ``step_N``
    directory, or a run's checkpoint directory (then its latest complete checkpoint).  Presence
    and sizes are verified here (a policy checksums its own files when it loads them); no RNG
    state is read and no identity matched: the caller compares ``identity`` with its own."""
    path = Path(path).expanduser().absolute()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    if not (path / mf.MANIFEST_NAME).exists() and not mf.STEP_DIR_RE.fullmatch(path.name):
        latest = CheckpointManager({"enabled": False, "checkpoint_dir": str(path)}, identity={}).latest_complete()
        if latest is None:
            raise CheckpointError(
                f"{path} holds no complete run checkpoint (a step_N/ directory with a checkpoint.json)"
            )
        path = latest
    manifest = mf.verify_manifest(path, checksums=False)
    return LoadedCheckpoint(
        step=manifest["step"],
        path=path,
        policy_dir=path / mf.POLICY_DIR,
        rng_state={},
        identity=manifest["identity"],
        **mf.read_driver_state(path, manifest),
    )
