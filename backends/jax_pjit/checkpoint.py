"""Orbax checkpoints of the JAX policy: ``save_checkpoint`` / ``load_checkpoint``.

The on-disk format is orbax's ``StandardCheckpointer`` (the params tree in ``weights_path``;
``{"opt_state", "train_step"}`` in ``optimizer_path``).  What this module adds is the trust
of ``core.checkpointing.policy_files``: every process writes into temporary siblings,
process 0 writes the manifests (sizes + sha256) last and renames the directories into place
(a previous checkpoint there is replaced only once the new one is complete); a load verifies
the manifests and compares orbax's metadata with the live trees (keys and shapes) before
any array is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from core.checkpointing import policy_files as pf
from core.checkpointing.manifest import CheckpointError
from core.distributed.recoverable import before_collectives

FORMAT = "orbax"  # the manifest's identity.format of a JAX policy checkpoint


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _shared_token() -> str:
    """One save's token, drawn by process 0 and agreed by every process."""
    token = pf.new_token()
    if jax.process_count() == 1:
        return token
    from jax.experimental import multihost_utils

    value = multihost_utils.broadcast_one_to_all(np.asarray(int(token, 16), np.int64))
    return f"{int(value):012x}"


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each array's sharding: the restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, tree
    )


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{"layers.0.mlp.up_proj.kernel": shape}`` of a live tree or of orbax's metadata tree
    (nnx's ``.value`` level, an attribute in one and a dict key in the other, is dropped)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [_key_name(k) for k in path]
        if names and names[-1] == "value":
            names = names[:-1]
        out[".".join(names)] = tuple(getattr(leaf, "shape", None) or ())
    return out


def _check_tree(ckptr: Any, path: Path, expected: Any, *, what: str, role: str) -> None:
    try:
        meta = ckptr.metadata(path)
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is one clear error
        raise CheckpointError(f"{role}={str(path)!r}: cannot read its orbax metadata: {e}") from e
    item = getattr(meta, "item_metadata", meta)
    tree = getattr(item, "tree", item)
    problem = pf.describe_mismatch(path, _shapes(expected), _shapes(tree), what=what, role=role)
    if problem:
        raise CheckpointError(problem)


def save_orbax(
    params: Any,
    opt_state: Any,
    train_step: int,
    weights_path: str | os.PathLike,
    optimizer_path: str | os.PathLike | None,
) -> None:
    """Every process: write the params (and optimizer state + step) atomically."""
    import orbax.checkpoint as ocp

    with before_collectives():  # every process checks the same paths: all raise together
        if optimizer_path is not None and opt_state is None:
            raise ValueError("save_checkpoint: optimizer_path given but this policy has no optimizer")
        pf.check_save_paths({"weights_path": weights_path, "optimizer_path": optimizer_path})
    targets = [(Path(weights_path).absolute(), pf.KIND_WEIGHTS)]
    if optimizer_path is not None:
        targets.append((Path(optimizer_path).absolute(), pf.KIND_OPTIMIZER))
    token = _shared_token()
    primary = jax.process_index() == 0
    temps = [pf.temp_path(p, token) for p, _ in targets]
    try:
        if primary:
            pf.prepare_save([p for p, _ in targets], token)
        _sync("dualrl-ckpt-prepared")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(temps[0], params, force=True)
            if optimizer_path is not None:
                ckptr.save(temps[1], {"opt_state": opt_state, "train_step": int(train_step)}, force=True)
            ckptr.wait_until_finished()
        _sync("dualrl-ckpt-written")  # every process's arrays are on disk
        if primary:
            pf.finish_save(
                [(tmp, path, kind) for tmp, (path, kind) in zip(temps, targets, strict=True)],
                fmt=FORMAT,
                token=token,
                train_step=train_step,
            )
        _sync("dualrl-ckpt-installed")
    except BaseException:
        if primary:
            pf.discard_temps(temps)
        raise


def load_orbax(
    params: Any,
    opt_state: Any,
    weights_path: str | os.PathLike,
    optimizer_path: str | os.PathLike | None,
    *,
    checksums: bool = True,
    what: str = "this model",
) -> tuple[Any, Any, int | None]:
    """Every process: verified restore; returns ``(params, opt_state, train_step)`` (the
    last two ``opt_state`` as given and None without ``optimizer_path``).

    Before any array is read: the manifests (sizes, and sha256 unless ``checksums=False``
    -- the driver already did), the kinds and the pairing, then orbax's metadata against
    the live trees (a CheckpointError naming the key and both shapes).
    """
    import orbax.checkpoint as ocp

    if optimizer_path is not None and opt_state is None:
        raise ValueError("load_checkpoint: optimizer_path given but this policy has no optimizer")
    pf.check_load_paths(weights_path, optimizer_path, fmt=FORMAT, checksums=checksums)
    weights_path = Path(weights_path).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        _check_tree(ckptr, weights_path, params, what=what, role="weights_path")
        target = None
        if optimizer_path is not None:
            optimizer_path = Path(optimizer_path).absolute()
            target = {"opt_state": _abstract(opt_state), "train_step": 0}
            _check_tree(ckptr, optimizer_path, target, what=f"the optimizer state of {what}", role="optimizer_path")
        params = ckptr.restore(weights_path, _abstract(params))
        if target is None:
            return params, opt_state, None
        restored = ckptr.restore(optimizer_path, target)
        return params, restored["opt_state"], int(restored["train_step"])
