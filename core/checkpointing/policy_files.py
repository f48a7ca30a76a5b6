"""Atomic, verified *policy* checkpoints: ``Policy.save_checkpoint(weights_path, optimizer_path)``.

The backends write their own format (torch DCP shards, orbax) -- this module only makes
the directories trustworthy, with the run checkpoints' manifest (:mod:`.manifest`):

* **Atomic.**  Every rank writes into a temporary sibling ``.tmp-<name>-<token>`` (same
  parent, so the final rename never crosses a filesystem).  When all ranks are done, rank 0
  writes the manifest last (sizes + sha256 of every file, fsync'd) and installs the
  directories: an existing checkpoint is first renamed to ``.old-<name>-<token>``, the new
  one renamed into place, and only then is the old one deleted.  A kill at any moment
  leaves the previous checkpoint or the new one, never a half one under the final name;
  :func:`restore_interrupted` puts a ``.old-*`` back if the kill fell between two renames.
* **Verified.**  :func:`check_load_paths` (the driver, and rank 0 of the workers) refuses a
  directory without a manifest ("incomplete checkpoint"), a truncated or altered file
  (named, with the path), a checkpoint of another format, a weights directory given as the
  optimizer's (or vice versa), an optimizer directory without its scheduler / step file,
  and a weights + optimizer pair written by two different saves.
* The manifest's ``identity`` says what the directory is: ``kind`` (weights / optimizer),
  ``format`` (``torch-dcp`` / ``orbax``), ``save_id`` (shared by the pair one save wrote)
  and the policy's ``train_step``.

Backend-free: no torch / jax import here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import core.checkpointing.manifest as mf
from core.checkpointing.manifest import CheckpointError
from core.reporting import get_logger

logger = get_logger(__name__)

__all__ = [
    "KIND_WEIGHTS",
    "KIND_OPTIMIZER",
    "new_token",
    "temp_path",
    "prepare_save",
    "finish_save",
    "discard_temps",
    "restore_interrupted",
    "check_save_paths",
    "check_load_paths",
    "describe_mismatch",
]

KIND_WEIGHTS = "policy-weights"
KIND_OPTIMIZER = "policy-optimizer"
_ROLE = {KIND_WEIGHTS: "weights_path", KIND_OPTIMIZER: "optimizer_path"}
_WHAT = {KIND_WEIGHTS: "a weights checkpoint", KIND_OPTIMIZER: "an optimizer checkpoint"}
#: What identifies a directory as some checkpoint (ours, or a bare DCP / orbax one), so an
#: overwrite never deletes a directory that holds anything else.
_CHECKPOINT_MARKERS = (mf.MANIFEST_NAME, ".metadata", "_CHECKPOINT_METADATA", "_METADATA")


def new_token() -> str:
    """The random part of one save's temp / old names (and its ``save_id``)."""
    return uuid.uuid4().hex[:12]


def temp_path(final: str | os.PathLike, token: str) -> Path:
    """Where a save writes before the rename: a hidden sibling of ``final``."""
    final = Path(final).absolute()
    return final.parent / f".tmp-{final.name}-{token}"


def _old_path(final: Path, token: str) -> Path:
    return final.parent / f".old-{final.name}-{token}"


def _replaceable(path: Path) -> bool:
    """Whether an existing ``path`` may be replaced by a new checkpoint: an empty
    directory or one that is a checkpoint already."""
    if not path.is_dir() or path.is_symlink():
        return False
    names = {p.name for p in path.iterdir()}
    return not names or any(m in names for m in _CHECKPOINT_MARKERS)


def check_save_paths(paths: Mapping[str, str | os.PathLike | None]) -> None:
    """Cheap checks before any rank writes (driver and workers): distinct paths, and
    nothing in the way that is not a checkpoint (an overwrite replaces the directory)."""
    given = {role: Path(p).absolute() for role, p in paths.items() if p is not None}
    seen: dict[Path, str] = {}
    for role, path in given.items():
        if path in seen:
            raise CheckpointError(f"save_checkpoint: {seen[path]} and {role} are the same directory {path}")
        seen[path] = role
        check_writable(path, f"save_checkpoint: {role}")
        if path.exists() and not _replaceable(path):
            kind = "a file" if not path.is_dir() else "a non-empty directory that is not a checkpoint"
            raise CheckpointError(
                f"save_checkpoint: {role}={str(path)!r} is {kind}; refusing to replace it "
                "(a save replaces the whole directory)"
            )


def check_writable(path: str | os.PathLike, role: str) -> None:
    """The nearest existing ancestor of ``path`` must be a writable directory: a save then
    can create its temp sibling and rename it into place."""
    path = Path(path).absolute()
    anchor = path.parent
    while not anchor.exists():
        anchor = anchor.parent
    if not anchor.is_dir():
        raise CheckpointError(f"{role}={str(path)!r}: {str(anchor)!r} is a file, not a directory")
    try:  # a real attempt: os.access says yes to root even on /proc or a read-only mount
        os.rmdir(tempfile.mkdtemp(prefix=".dualrl-write-probe-", dir=anchor))
    except OSError as exc:
        raise CheckpointError(
            f"{role}={str(path)!r}: cannot create directories in {str(anchor)!r} ({exc.strerror or exc})"
        ) from None


def prepare_save(finals: Iterable[str | os.PathLike], token: str) -> list[Path]:
    """Rank 0, before the collective write: parents created, temp dirs (absent) named."""
    temps = []
    for final in finals:
        tmp = temp_path(final, token)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        temps.append(tmp)
    return temps


def discard_temps(temps: Iterable[Path]) -> None:
    """Best-effort removal of a failed save's temp dirs (must not mask the error)."""
    for tmp in temps:
        shutil.rmtree(tmp, ignore_errors=True)


def _manifest_step(final: Path, train_step: int) -> int:
    """The manifest's ``step``: the policy's train step, unless the directory's name is a
    run checkpoint's ``step_N`` (the manifest module checks that the two agree)."""
    m = mf.STEP_DIR_RE.fullmatch(final.name)
    return int(m.group(1)) if m else max(int(train_step), 0)


def finish_save(
    written: Sequence[tuple[Path, str | os.PathLike, str]],
    *,
    fmt: str,
    token: str,
    train_step: int,
    required: Mapping[str, Sequence[str]] | None = None,
) -> list[Path]:
    """Rank 0, after every rank finished writing: manifest each temp dir, then install.

    ``written``: ``(temp dir, final path, kind)`` per directory.  ``required``: per kind,
    files that must be present (e.g. the torch optimizer's scheduler / step file).
    All manifests are written before any rename; the old directories are deleted only
    after every new one is in place.  Returns the final paths.
    """
    for tmp, _, kind in written:
        if not tmp.is_dir():
            raise CheckpointError(f"save_checkpoint: the backend wrote nothing at {tmp}")
        for name in (required or {}).get(kind, ()):
            if not (tmp / name).is_file():
                raise CheckpointError(f"save_checkpoint: {name} is missing from {tmp}")
    for tmp, final, kind in written:
        identity = {"kind": kind, "format": fmt, "save_id": token, "train_step": int(train_step)}
        mf.write_manifest(tmp, _manifest_step(Path(final), train_step), identity)  # last write
    olds: list[Path] = []
    finals: list[Path] = []
    for tmp, final, _ in written:
        final = Path(final).absolute()
        old = mf.install_dir(Path(tmp), final, _old_path(final, token))
        finals.append(final)
        if old is not None:
            olds.append(old)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
    return finals


def restore_interrupted(final: str | os.PathLike) -> bool:
    """If a save died between moving ``final`` aside and renaming the new one into place,
    put the previous checkpoint back (with a warning).  Returns whether it did."""
    final = Path(final).absolute()
    if final.exists() or not final.parent.is_dir():
        return False
    olds = sorted(final.parent.glob(f".old-{final.name}-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in olds:
        try:
            mf.verify_manifest(old, checksums=False)
        except CheckpointError:
            continue
        os.replace(old, final)
        mf.fsync_dir(final.parent)
        logger.warning("restored %s from %s: a save over it was interrupted", final, old.name)
        return True
    return False


def _verify(path: Path, kind: str, fmt: str, *, checksums: bool, required: Sequence[str]) -> dict:
    """One directory: complete, intact, of ``kind`` and ``fmt``."""
    role = _ROLE[kind]
    if not path.exists():
        raise CheckpointError(f"{role}={str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{role}={str(path)!r} is not a directory")
    if not (path / mf.MANIFEST_NAME).is_file():
        hint = ""
        if (path / ".metadata").is_file() or (path / "_CHECKPOINT_METADATA").is_file():
            hint = " (its shards are there, but without the manifest nothing proves they are all there and whole)"
        raise CheckpointError(
            f"incomplete checkpoint: {role}={str(path)!r} has no {mf.MANIFEST_NAME}, so the save that "
            f"wrote it did not finish{hint}"
        )
    try:
        manifest = mf.verify_manifest(path, checksums=checksums)
    except CheckpointError as e:
        raise CheckpointError(f"{role}={str(path)!r}: {e}") from e
    ident = manifest["identity"]
    found_kind, found_fmt = ident.get("kind"), ident.get("format")
    if found_kind != kind:
        what = _WHAT.get(found_kind, f"a checkpoint of kind {found_kind!r} (not a policy checkpoint)")
        other = f"; pass it as {_ROLE[found_kind]}" if found_kind in _ROLE else ""
        raise CheckpointError(f"{role}={str(path)!r} is {what}, not {_WHAT[kind]}{other}")
    if found_fmt != fmt:
        raise CheckpointError(
            f"{role}={str(path)!r} holds a {found_fmt!r} checkpoint; this policy's backend reads {fmt!r}"
        )
    for name in required:
        if name not in manifest["files"]:
            raise CheckpointError(
                f"{role}={str(path)!r} has no {name} (the scheduler state and step counter): refusing to "
                "load the optimizer state without them"
            )
    return manifest


def check_load_paths(
    weights_path: str | os.PathLike | None,
    optimizer_path: str | os.PathLike | None,
    *,
    fmt: str,
    checksums: bool = True,
    optimizer_required: Sequence[str] = (),
    restore: bool = False,
) -> None:
    """Everything about the directories that can be checked before a shard is read.

    Raises :class:`CheckpointError` naming the path (and the file).  ``restore=True``
    (the driver) first puts back a checkpoint an interrupted save moved aside.
    """
    if weights_path is None:
        if optimizer_path is not None:
            raise CheckpointError(f"optimizer_path={str(optimizer_path)!r} given without a weights_path")
        return
    paths: list[tuple[Path, str, tuple[str, ...]]] = [(Path(weights_path).absolute(), KIND_WEIGHTS, ())]
    if optimizer_path is not None:
        paths.append((Path(optimizer_path).absolute(), KIND_OPTIMIZER, tuple(optimizer_required)))
    manifests = []
    for path, kind, required in paths:
        if restore:
            restore_interrupted(path)
        manifests.append(_verify(path, kind, fmt, checksums=checksums, required=required))
    if len(manifests) == 2:
        w, o = (m["identity"].get("save_id") for m in manifests)
        if w != o:
            raise CheckpointError(
                f"weights_path={str(paths[0][0])!r} and optimizer_path={str(paths[1][0])!r} were written by "
                f"different saves (save_id {w!r} vs {o!r}): the optimizer state would not match the weights"
            )


def describe_mismatch(
    path: str | os.PathLike,
    expected: Mapping[str, tuple],
    found: Mapping[str, tuple],
    *,
    what: str,
    role: str = "weights_path",
    limit: int = 8,
) -> str | None:
    """A message naming the keys / shapes where a checkpoint's tensors differ from the
    model's, or None when they agree."""
    lines = []
    for key in sorted(expected.keys() & found.keys()):
        if tuple(expected[key]) != tuple(found[key]):
            lines.append(
                f"key {key!r}: the model has shape {tuple(expected[key])}, the checkpoint has shape {tuple(found[key])}"
            )
    lines += [
        f"key {k!r} (shape {tuple(expected[k])}) is in the model but not in the checkpoint"
        for k in sorted(expected.keys() - found.keys())
    ]
    lines += [
        f"key {k!r} (shape {tuple(found[k])}) is in the checkpoint but not in the model"
        for k in sorted(found.keys() - expected.keys())
    ]
    if not lines:
        return None
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    return (
        f"{role}={str(path)!r} does not fit {what} (another architecture or size?): "
        f"{len(lines)} difference(s):\n  " + "\n  ".join(lines[:limit]) + more
    )
