"""The completeness manifest of a run checkpoint: ``step_N/checkpoint.json``.

A step directory is a *complete* checkpoint iff its manifest exists and verifies: the
manifest is written last (temp name, fsync, ``os.replace``), after every other file of the
checkpoint has been fsync'd, so its presence proves the save finished; the sizes and
sha256 it lists prove that nothing was truncated or altered since.  Files that are not
listed (e.g. a note a user dropped in the directory) are ignored.

The driver-state files' names and encodings live here too: this module is the on-disk
format, ``manager`` the procedure.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

__all__ = [
    "CheckpointError",
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "write_manifest",
    "verify_manifest",
    "fsync_dir",
    "install_dir",
    "serialize_driver_state",
    "read_state_file",
    "decode_metrics",
    "read_driver_state",
]

MANIFEST_NAME = "checkpoint.json"
MANIFEST_FORMAT = "dualrl-run-checkpoint"
MANIFEST_VERSION = 1
POLICY_DIR, TRAIN_STATE_FILE, RNG_FILE = "policy", "train_state.json", "rng_state.pkl"
CONFIG_FILE, METRICS_FILE = "config.yaml", "metrics.json"
_NONFINITE = ("nan", "inf", "-inf")
_CHUNK = 1 << 20  # 1 MiB: bounded memory however large the backend's shards are
STEP_DIR_RE = re.compile(r"step_(0|[1-9][0-9]*)")


class CheckpointError(RuntimeError):
    """A run checkpoint is missing, partial, corrupt, foreign, or cannot be written."""


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new / renamed children) to disk.

    Best effort: some filesystems (and non-POSIX platforms) refuse ``fsync`` on a
    directory; there the rename is as durable as that filesystem makes it anyway.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def install_dir(tmp: Path, final: Path, old: Path) -> Path | None:
    """Rename the complete directory ``tmp`` to ``final``; an existing ``final`` is first moved
    aside to ``old`` (``os.replace`` cannot overwrite a non-empty directory) and put back if
    the second rename fails.  Returns where the previous directory now is (None: there was
    none) for the caller to delete once everything is in place."""
    moved = None
    if final.exists() or final.is_symlink():
        os.replace(final, old)
        moved = old
    try:
        os.replace(tmp, final)
    except BaseException:
        if moved is not None:
            os.replace(moved, final)
        raise
    fsync_dir(final.parent)
    return moved


def _sha256(path: Path, *, sync: bool = False) -> str:
    """sha256 of ``path`` read in 1 MiB chunks.  ``sync=True`` also fsyncs the file so
    that, once the manifest is on disk, the bytes it vouches for are too (even across a
    power loss, not only a process crash)."""
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _listed_files(step_dir: Path) -> list[tuple[str, Path]]:
    """Every file under ``step_dir`` except the manifest (and its temp), as sorted
    (posix relpath, path) pairs; directories are fsync'd on the way."""
    out: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(step_dir):
        dirs.sort()
        root_path = Path(root)
        for name in files:
            path = root_path / name
            rel = path.relative_to(step_dir).as_posix()
            if rel in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
                continue
            out.append((rel, path))
        fsync_dir(root_path)
    return sorted(out)


def write_manifest(step_dir: Path, step: int, identity: Mapping[str, Any]) -> dict:
    """Record size + sha256 of every file under ``step_dir`` in ``checkpoint.json``.

    Must be the last write of a save: the manifest's presence is what marks the checkpoint
    complete.  Returns the manifest written.
    """
    step_dir = Path(step_dir)
    files = {}
    for rel, path in _listed_files(step_dir):
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path, sync=True)}
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "step": int(step),
        "created": datetime.now(UTC).isoformat(),
        "identity": dict(identity),
        "files": files,
    }
    tmp = step_dir / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST_NAME)
    fsync_dir(step_dir)
    return manifest


def _read_manifest(step_dir: Path) -> dict:
    """Parse and check the header of ``step_dir``'s manifest (not the files)."""
    path = step_dir / MANIFEST_NAME
    if not step_dir.is_dir():
        raise CheckpointError(f"checkpoint {step_dir} is not a directory")
    if not path.is_file():
        raise CheckpointError(f"partial checkpoint: {step_dir} has no {MANIFEST_NAME} (the save did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST_NAME} is unreadable: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(
            f"checkpoint {step_dir}: {MANIFEST_NAME} has format {fmt!r}, "
            f"expected {MANIFEST_FORMAT!r} (not a dualrl run checkpoint)"
        )
    if manifest.get("version") != MANIFEST_VERSION:
        raise CheckpointError(
            f"checkpoint {step_dir}: {MANIFEST_NAME} has version {manifest.get('version')!r}; "
            f"this dualrl reads version {MANIFEST_VERSION}"
        )
    _check_header_fields(step_dir, manifest)
    return manifest


def _check_header_fields(step_dir: Path, manifest: dict) -> None:
    """Types of step / identity / files, and a step that agrees with the dir name (a
    renamed or copied-over directory must not pass for another step)."""
    step, files = manifest.get("step"), manifest.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST_NAME} key 'step' is {step!r}")
    if not isinstance(manifest.get("identity"), dict):
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST_NAME} key 'identity' is not a mapping")
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST_NAME} key 'files' is not a mapping")
    m = STEP_DIR_RE.fullmatch(step_dir.name)
    if m and int(m.group(1)) != step:
        raise CheckpointError(
            f"checkpoint {step_dir}: {MANIFEST_NAME} says step {step}, the directory says {m.group(1)}"
        )


def _check_file(step_dir: Path, rel: str, entry: Any, checksums: bool) -> None:
    """One listed file: present, same size and (optionally) same sha256."""
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or not isinstance(entry, dict):
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST_NAME} has a bad entry {rel!r}")
    path = step_dir / pure
    if not path.is_file():
        raise CheckpointError(f"checkpoint {step_dir}: file {rel!r} listed in {MANIFEST_NAME} is missing")
    size = path.stat().st_size
    if size != entry.get("size"):
        raise CheckpointError(
            f"checkpoint {step_dir}: file {rel!r} is truncated or altered: "
            f"expected {entry.get('size')} bytes, found {size}"
        )
    if checksums:
        actual = _sha256(path)
        if actual != entry.get("sha256"):
            raise CheckpointError(
                f"checkpoint {step_dir}: file {rel!r} is corrupt: sha256 {actual} "
                f"differs from the recorded {entry.get('sha256')} (same size, different bytes)"
            )


def verify_manifest(step_dir: Path, *, checksums: bool = True) -> dict:
    """Return ``step_dir``'s manifest if the checkpoint is complete and intact.

    Raises :class:`CheckpointError` naming ``step_dir`` and the first problem found.
    ``checksums=False`` checks presence and sizes only (cheap: a stat per file).
    """
    step_dir = Path(step_dir)
    manifest = _read_manifest(step_dir)
    for rel in sorted(manifest["files"]):
        _check_file(step_dir, rel, manifest["files"][rel], checksums)
    return manifest


# ----------------------------------------------------------------------------- driver state files
def _to_plain(obj: Any, nonfinite_as_str: bool) -> Any:
    """Mappings -> dict, tuples -> list, numpy / torch scalars -> Python numbers; with
    ``nonfinite_as_str`` nan / inf become strings (metrics.json stays standard JSON)."""
    if isinstance(obj, Mapping):
        return {k: _to_plain(v, nonfinite_as_str) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v, nonfinite_as_str) for v in obj]
    if isinstance(obj, float) and nonfinite_as_str and not math.isfinite(obj):
        return str(obj)  # 'nan', 'inf', '-inf'
    if hasattr(obj, "item") and getattr(obj, "shape", None) == ():
        return _to_plain(obj.item(), nonfinite_as_str)
    return obj


def decode_metrics(obj: Any) -> Any:
    """Inverse of the nan / inf encoding of metrics.json."""
    if isinstance(obj, dict):
        return {k: decode_metrics(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_metrics(v) for v in obj]
    return float(obj) if isinstance(obj, str) and obj in _NONFINITE else obj


def serialize_driver_state(step: int, train_state: Mapping, config: Mapping, metrics: Mapping) -> dict[str, str]:
    """The driver-state files' text, produced before the (slow) policy write so that an
    unserializable value fails the save at once, naming what it was."""
    out = {}
    for name, value, dump in (
        (TRAIN_STATE_FILE, _to_plain(train_state, False), lambda v: json.dumps(v, indent=1)),
        (CONFIG_FILE, _to_plain(config, False), lambda v: yaml.safe_dump(v, sort_keys=False)),
        (METRICS_FILE, _to_plain(metrics, True), lambda v: json.dumps(v, indent=1, allow_nan=False)),
    ):
        try:
            out[name] = dump(value)
        except (TypeError, ValueError, yaml.YAMLError) as e:
            raise CheckpointError(f"step {step}: cannot write {name}: {type(e).__name__}: {e}") from e
    return out


def read_state_file(path: Path, parse: Callable[[str], Any]) -> Any:
    """``parse`` of a text file of a checkpoint; a CheckpointError naming the file."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from e


def read_driver_state(step_dir: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``train_state`` / ``config`` / ``metrics`` of a verified checkpoint.  Each file must
    be listed in its manifest (an unlisted one was never verified), and so must at least
    one policy file: a checkpoint without the policy's state is no checkpoint."""
    listed = manifest["files"]
    for name in (TRAIN_STATE_FILE, CONFIG_FILE, METRICS_FILE):
        if name not in listed:
            raise CheckpointError(f"checkpoint {step_dir}: {name} is not in its {MANIFEST_NAME}")
    if not any(rel == POLICY_DIR or rel.startswith(POLICY_DIR + "/") for rel in listed):
        raise CheckpointError(f"checkpoint {step_dir}: no {POLICY_DIR} files in its {MANIFEST_NAME}")
    return {
        "train_state": read_state_file(step_dir / TRAIN_STATE_FILE, json.loads),
        "config": read_state_file(step_dir / CONFIG_FILE, yaml.safe_load) or {},
        "metrics": decode_metrics(read_state_file(step_dir / METRICS_FILE, json.loads)),
    }
