"""The Policies a parity run measures: ``benchmarks.lib.policy.PolicyRunner`` with the parity settings
(one micro batch per rank, gbs = the batch, the constant learning rate of :func:`parity_settings`)."""

from __future__ import annotations

import sys

from benchmarks.lib.parity.exact import exact_settings
from benchmarks.lib.parity.models import parity_settings
from benchmarks.lib.policy import PolicyRunner


def parity_runner(name: str, model_path: str, tokenizer_path: str, tokenizer, args, **policy_kwargs) -> PolicyRunner:
    """The layout ``name`` on ``model_path`` (Ray must already be up with the right devices);
    ``policy_kwargs``: e.g. a DCP checkpoint's ``weights_path`` / ``optimizer_path``."""
    return PolicyRunner(
        name,
        model_path,
        tokenizer_path,
        tokenizer,
        args,
        settings=lambda cfg: _settings(cfg, args),
        **policy_kwargs,
    )


def _settings(cfg: dict, args) -> dict:
    cfg = parity_settings(cfg, args.lr)
    return exact_settings(cfg) if getattr(args, "exact", False) else cfg


def new_runner(name: str, model_path: str, tokenizer_path: str, tokenizer, args) -> PolicyRunner:
    print(f"[parity] starting {name} on {model_path} ...", file=sys.stderr, flush=True)
    return parity_runner(name, model_path, tokenizer_path, tokenizer, args)
