"""The JAX worker's compiled grad steps are keyed by the loss's settings
(``core.losses.contract.loss_cache_key``: the loss's ``cache_key()``): copies of one configured
loss share a program, any two configurations do not.  A key blind to the typed config section once trained a loss with
importance weights on the program compiled for a loss without them (a 31 % wrong loss)."""

from __future__ import annotations

import pickle

from core.losses import ClippedPGLossFn, DPOLossFn, NLLLoss
from core.losses.contract import loss_cache_key as loss_key
from tests.hf_reference import PG_CFG


def test_copies_share_a_key_and_every_setting_changes_it():
    base = ClippedPGLossFn(PG_CFG)
    assert loss_key(pickle.loads(pickle.dumps(base))) == loss_key(base)
    variants = [
        ClippedPGLossFn({**PG_CFG, "use_importance_sampling_correction": True}),
        ClippedPGLossFn({**PG_CFG, "reference_policy_kl_penalty": 0.0}),
        ClippedPGLossFn({**PG_CFG, "ratio_clip_max": 0.28}),
        ClippedPGLossFn({**PG_CFG, "token_level_loss": False}),
        ClippedPGLossFn(PG_CFG, old_logprobs="forward"),
        NLLLoss(),
    ]
    keys = [loss_key(base)] + [loss_key(v) for v in variants]
    assert len(set(keys)) == len(keys)


def test_dpo_settings_are_in_the_key():
    cfg = {
        "reference_policy_kl_penalty": 0.1,
        "preference_loss_weight": 1.0,
        "sft_loss_weight": 0.0,
        "preference_average_log_probs": False,
        "sft_average_log_probs": False,
    }
    assert loss_key(DPOLossFn(cfg)) == loss_key(DPOLossFn(dict(cfg)))
    assert loss_key(DPOLossFn(cfg)) != loss_key(DPOLossFn({**cfg, "reference_policy_kl_penalty": 0.2}))
