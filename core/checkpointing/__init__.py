"""Run checkpoints: atomic ``step_N/`` directories holding the policy's state (in the
backend's own format) and the driver's state (data position, RNG, step, config, metrics),
with a manifest that tells a complete checkpoint from a partial or corrupt one; pruning
and resume.  Backend-free: the policy's files are written through a callback.

Layout of ``checkpointing.checkpoint_dir``::

    step_20/                 a complete checkpoint (checkpoint.json written last)
      policy/                the backend's own files (torch DCP / orbax), written by the
                             policy's workers through the ``write_policy`` callback
      train_state.json       what the loop passed (data position, counters...)
      rng_state.pkl          the driver's RNG state (pickle: see core.checkpointing.rng)
      config.yaml            the run config
      metrics.json           last metrics; nan / inf stored as the strings "nan", "inf", "-inf"
      checkpoint.json        the manifest (core.checkpointing.manifest)
    .tmp-step_30-1a2b3c4d/   a save in progress (or one that crashed)
    .old-step_20-.../        the previous step_20 while a re-save of step 20 swaps it out
    .trash-step_10-.../      a pruned checkpoint being deleted
"""

from core.checkpointing.manager import CheckpointManager, LoadedCheckpoint, read_checkpoint
from core.checkpointing.manifest import CheckpointError, verify_manifest, write_manifest
from core.checkpointing.rng import capture_rng_state, restore_rng_state

__all__ = [
    "CheckpointManager",
    "LoadedCheckpoint",
    "read_checkpoint",
    "CheckpointError",
    "write_manifest",
    "verify_manifest",
    "capture_rng_state",
    "restore_rng_state",
]
