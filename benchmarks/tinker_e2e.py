"""The Tinker API end to end: ``dualrl serve`` on each backend, driven by the unmodified tinker SDK.

    python -m benchmarks.tinker_e2e [--backends torch_fsdp torch_dtensor jax_pjit] [--sft-steps 20]
        [--rl-steps 30] [--lora-rank 16] [--json OUT]

Per backend, one server in this process (a thread; the policy on Ray as ``dualrl serve`` runs
it) and three client programs of :mod:`benchmarks.tinker_client`, each on its own session
and training client:

1. ``first_step``: one forward_backward + optim_step on a fixed batch (LoRA seed fixed), for
   the step-1 agreement of the backends;
2. ``sft``: the SFT loop from ``builtin:arithmetic-llama-base`` (random weights): the loss curve;
3. ``rl``: the cookbook-shaped RL loop from ``builtin:arithmetic-llama`` (the warm start):
   the reward curve and the greedy held-out accuracy before / after.

Prints each curve and the wall times; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from typing import Any

from benchmarks import tinker_client
from core.policy.registry import backend_names

#: Host devices of a JAX worker (the cluster's two slots), set before Ray starts.
JAX_DEVICES = 2


def server_config(backend: str, model: str, checkpoint_dir: str) -> Any:
    from core.tinker_api.config import load_serve_config

    overrides = [f"policy.model_name={model}", f"policy.tokenizer.name={model}", "serve.port=0"]
    return load_serve_config(None, overrides + [f"serve.checkpoint_dir={checkpoint_dir}"], backend)


def run_program(backend: str, model: str, program: str, args: argparse.Namespace) -> dict[str, Any]:
    """One server on ``backend`` serving ``model``, one session running ``program``."""
    import tinker

    from core.tinker_api.serve import ServerThread

    start = time.perf_counter()
    server = ServerThread(server_config(backend, model, f"{args.checkpoint_dir}/{backend}-{program}"))
    started = time.perf_counter()
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-dualrl-local")
    try:
        training = client.create_lora_training_client(model, rank=args.lora_rank, seed=0, train_unembed=False).result()
        tokenizer = training.get_tokenizer()
        created = time.perf_counter()
        result: dict[str, Any]
        if program == "first_step":
            result = asdict(tinker_client.first_step(training, tokenizer))
        elif program == "sft":
            result = {"loss": tinker_client.sft_loop(training, tokenizer, args.sft_steps)}
        else:
            run = tinker_client.rl_loop(
                training, tokenizer, args.rl_steps, groups=args.groups, group_size=args.group_size, lr=args.rl_lr
            )
            result = asdict(run)
        result.update(
            server_start_s=started - start, model_start_s=created - started, program_s=time.perf_counter() - created
        )
        return result
    finally:
        client.close("success").result()
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tinker_e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", choices=backend_names(), default=list(backend_names()))
    parser.add_argument(
        "--programs", nargs="+", choices=("first_step", "sft", "rl"), default=["first_step", "sft", "rl"]
    )
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--rl-lr", type=float, default=1e-3)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--checkpoint-dir", default="runs/tinker-e2e")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from core.distributed.ray_init import start_ray

    start_ray(num_cpus=4, jax_cpu_devices=JAX_DEVICES)
    models = {"first_step": "builtin:arithmetic-llama-base", "sft": "builtin:arithmetic-llama-base"}
    results: dict[str, dict[str, Any]] = {}
    for backend in args.backends:
        for program in args.programs:
            out = run_program(backend, models.get(program, "builtin:arithmetic-llama"), program, args)
            results.setdefault(backend, {})[program] = out
            print(f"{backend} {program}: {_summary(program, out)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _summary(program: str, out: dict[str, Any]) -> str:
    times = f"server {out['server_start_s']:.1f} s, model {out['model_start_s']:.1f} s, run {out['program_s']:.1f} s"
    if program == "first_step":
        return f"loss {out['loss']:.6f} grad_norm {out['grad_norm']:.6f} loss after {out['loss_after']:.6f} ({times})"
    if program == "sft":
        curve = " ".join(f"{x:.3f}" for x in out["loss"])
        return f"loss per answer token {curve} ({times})"
    rewards = " ".join(f"{s['reward']:.2f}" for s in out["steps"])
    return (
        f"reward per step {rewards}; held-out accuracy (8 samples each) {out['accuracy_before']:.3f} -> "
        f"{out['accuracy_after']:.3f}, greedy {out['greedy_before']:.3f} -> {out['greedy_after']:.3f} ({times})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
