"""The Policies a parity run measures: the benchmarks' runners with the parity settings."""

from __future__ import annotations

import sys
import time

from benchmarks import jax_backend as jb
from benchmarks import torch_backends as tb
from benchmarks.layouts import Layout, torch_layout
from benchmarks.parity.models import jax_devices, parity_settings


class _ParitySettings:
    """Mixin over the benchmark runners: their cluster/Policy start-up, with ``parity_settings``."""

    def _start(self, name, cfg, tokenizer, args, *rest):
        super()._start(name, parity_settings(cfg, args.lr), tokenizer, args, *rest)


class TorchParityRunner(_ParitySettings, tb.PolicyRunner):
    """A torch layout as ``benchmarks.torch_backends`` starts it (one micro batch per rank)."""


class JaxParityRunner(_ParitySettings, jb.JaxPolicyRunner):
    """A JAX layout as ``benchmarks.jax_backend`` starts it (one actor, one micro batch)."""


class TorchPolicyStart(tb.PolicyRunner):
    """A torch layout started the way ``torch_backends.PolicyRunner`` starts one (its ``close``) -- its policy
    section (``policy_config`` + ``parity_settings``), a cluster of one bundle of
    ``--threads // workers`` CPUs per worker, gbs = the batch, one micro batch per rank -- for
    what that runner does not do: a layout name it does not list, and a Policy constructed
    from a DCP checkpoint (``weights_path`` / ``optimizer_path``)."""

    def __init__(
        self,
        layout: Layout,
        model_path: str,
        tokenizer_path: str,
        tokenizer,
        args,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        tag: str = "parity",
    ) -> None:
        from core.distributed import RayVirtualCluster
        from core.policy import Policy

        cfg = parity_settings(
            tb.policy_config(model_path, tokenizer_path, layout, args.batch, args.seq, args.precision), args.lr
        )
        self.name = layout.name
        self._gbs, self._mbs = args.batch, cfg["train_micro_batch_size"]
        self._cluster = RayVirtualCluster(
            [layout.workers],
            use_gpus=False,
            num_cpus_per_bundle=max(1, args.threads // layout.workers),
            name=f"{tag}-{layout.name}",
        )
        self._policy = None
        try:
            t0 = time.perf_counter()
            self._policy = Policy(
                self._cluster,
                cfg,
                tokenizer,
                name_prefix=f"{tag}-{layout.name}",
                weights_path=weights_path,
                optimizer_path=optimizer_path,
            )
            self.startup_s = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise


def new_runner(name: str, model_path: str, tokenizer_path: str, tokenizer, args):
    """The runner of ``name`` on ``model_path`` (Ray must already be up with the right devices)."""
    print(f"[parity] starting {name} on {model_path} ...", file=sys.stderr, flush=True)
    if jax_devices(name):
        return JaxParityRunner(name, model_path, tokenizer_path, tokenizer, args)
    if name in tb.LAYOUTS:
        return TorchParityRunner(name, model_path, tokenizer_path, tokenizer, args)
    return TorchPolicyStart(torch_layout(name), model_path, tokenizer_path, tokenizer, args)
