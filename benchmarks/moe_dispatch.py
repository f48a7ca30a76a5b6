"""The JAX expert dispatches (dense, grouped, blocked) on one MoE layer, side by side.

    python -m benchmarks.moe_dispatch [--models qwen3_moe_bench PATH/config.json ...]
        [--tokens 4096 16384] [--dtype bfloat16|float32] [--dispatches dense grouped blocked]
        [--blocks 128] [--iters 5] [--json PATH]

Each model is a tiny-registry name (``core.testing.tiny_models``) or an HF ``config.json``
(its ``hidden_size``, ``moe_intermediate_size``, ``num_experts``, ``num_experts_per_tok``; e.g.
``tests/data/hf_configs/Qwen3-30B-A3B/config.json``).  For each model, token count and
dispatch (``backends.jax_pjit.models.moe_dispatch``; ``blocked`` once per ``--blocks`` size,
always blocked, not the model's dense-below-a-threshold choice) on JAX's default device:

* the forward and the forward + backward (gradients w.r.t. the tokens, routing weights and the
  three kernels), each one jitted program, median wall seconds of ``--iters`` calls after one
  untimed call (the compile), the device synchronised before the clock is read;
* ``x dense``: dense's seconds over this dispatch's, in the same run (> 1 = faster);
* ``err``: the largest |difference| from dense's output relative to dense's largest |value|
  (the same inputs; rounding only -- fp32 runs at ``highest`` matmul precision).

Routing: each token's ``num_experts_per_tok`` distinct experts drawn uniformly, weights
normalised (what a balanced router gives).  Inputs are made with numpy on the host and placed
once; nothing but the jitted programs is timed.  This is what ``policy.jax_cfg.moe_dispatch:
auto`` is chosen from (``resolve_dispatch``): measure on the machine that will train.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.lib.markdown import cell, table


@dataclasses.dataclass(frozen=True)
class Layer:
    """One MoE layer's shape: embed E, expert MLP width M, experts X, top-k K."""

    name: str
    embed: int
    mlp: int
    experts: int
    top_k: int


def layer_of(model: str) -> Layer:
    """A tiny-registry name or an HF config.json path -> its MoE layer's shape."""
    if model.endswith(".json"):
        fields = json.loads(Path(model).read_text())
        name = Path(model).parent.name or model
    else:
        from core.testing.tiny_models import TINY_MODELS

        if model not in TINY_MODELS:
            raise SystemExit(f"--models: {model!r} is neither a config.json path nor one of {sorted(TINY_MODELS)}")
        fields, name = TINY_MODELS[model], model
    missing = [
        k for k in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok") if k not in fields
    ]
    if missing:
        raise SystemExit(f"--models {model}: not a MoE config (no {', '.join(missing)})")
    return Layer(
        name,
        fields["hidden_size"],
        fields["moe_intermediate_size"],
        fields["num_experts"],
        fields["num_experts_per_tok"],
    )


def inputs(layer: Layer, tokens: int, dtype: str, seed: int = 0) -> tuple:
    """(x, index, weight, gate, up, down) on the default device (see the module docstring)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    index = np.argsort(rng.random((tokens, layer.experts)), axis=1)[:, : layer.top_k]
    weight = rng.random((tokens, layer.top_k)) + 0.1
    scale = layer.embed**-0.5
    arrays = (
        rng.standard_normal((tokens, layer.embed)),
        weight / weight.sum(axis=1, keepdims=True),
        *(scale * rng.standard_normal((layer.experts, layer.embed, layer.mlp)) for _ in range(2)),
        layer.mlp**-0.5 * rng.standard_normal((layer.experts, layer.mlp, layer.embed)),
    )
    x, weight, gate, up, down = (jnp.asarray(a, dtype) for a in arrays)
    return x, jnp.asarray(index, jnp.int32), weight, gate, up, down


def programs(fn: Callable) -> tuple[Callable, Callable]:
    """(forward, forward + backward) of one dispatch, each one jitted program."""
    import jax

    def loss(x, index, weight, gate, up, down):
        out = fn(x, index, weight, gate, up, down)
        return (out.astype(np.float32) ** 2).sum()

    forward = jax.jit(fn)
    backward = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5)))
    return forward, backward


def median_seconds(program: Callable, args: tuple, iters: int) -> float:
    import jax

    jax.block_until_ready(program(*args))  # compile + first run, untimed
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dispatches(names: list[str], blocks: list[int]) -> dict[str, Callable]:
    from backends.jax_pjit.models.moe_dispatch import blocked_experts, dense_experts, grouped_experts

    table_ = {"dense": dense_experts, "grouped": grouped_experts}
    out: dict[str, Callable] = {}
    for name in names:
        if name == "blocked":
            out |= {f"blocked-{b}": functools.partial(blocked_experts, block=b) for b in blocks}
        else:
            out[name] = table_[name]
    return out


def measure(layer: Layer, tokens: int, dtype: str, fns: dict[str, Callable], iters: int) -> list[dict]:
    """One row per dispatch (dense first: the others' ratios and errors are against it)."""
    args = inputs(layer, tokens, dtype)
    rows, reference = [], None
    for name, fn in fns.items():
        forward, backward = programs(fn)
        row = {"model": layer.name, "tokens": tokens, "dtype": dtype, "dispatch": name}
        try:
            out = np.asarray(forward(*args), np.float64)
            row |= {"forward_s": median_seconds(forward, args, iters), "train_s": median_seconds(backward, args, iters)}
            if reference is None and name == "dense":
                reference = out
            if reference is not None:
                row["err"] = float(np.abs(out - reference).max() / max(np.abs(reference).max(), 1e-30))
        except Exception as e:  # noqa: BLE001 -- one failed case (say, out of memory) is a row, not the end
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    dense = next((r for r in rows if r["dispatch"] == "dense" and "error" not in r), None)
    for r in rows:
        if dense is not None and "error" not in r:
            r["forward_x"] = dense["forward_s"] / r["forward_s"]
            r["train_x"] = dense["train_s"] / r["train_s"]
    return rows


def report(rows: list[dict]) -> str:
    body = [
        [
            r["model"],
            str(r["tokens"]),
            r["dispatch"],
            cell(1e3 * r["forward_s"], ".2f") if "forward_s" in r else r.get("error", "-"),
            cell(r.get("forward_x"), ".2f"),
            cell(1e3 * r["train_s"], ".2f") if "train_s" in r else "-",
            cell(r.get("train_x"), ".2f"),
            cell(r.get("err"), ".1e"),
        ]
        for r in rows
    ]
    header = ["model", "tokens", "dispatch", "forward ms", "x dense", "fwd+bwd ms", "x dense", "err"]
    return "\n".join(table(header, body))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3_moe_bench"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--dispatches", nargs="+", choices=["dense", "grouped", "blocked"], default=["dense", "grouped", "blocked"]
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[128], help="blocked's rows per block")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file (one JSON object per line)")
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.iters < 1 or min(args.blocks) < 1:
        parser.error("--tokens, --iters and --blocks must be >= 1")
    layers = [layer_of(m) for m in args.models]

    import jax

    from benchmarks.lib.machine import software_versions

    device = jax.devices()[0]
    versions = software_versions(("jax", "jaxlib"))
    print(f"# device: {device.platform} {device.device_kind} x{jax.device_count()}; jax {versions['jax']}")
    fns = dispatches(args.dispatches, args.blocks)
    rows = []
    with jax.default_matmul_precision("highest" if args.dtype == "float32" else "default"):
        for layer in layers:
            for tokens in args.tokens:
                rows += measure(layer, tokens, args.dtype, fns, args.iters)
    print(report(rows))
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r | {"device": device.device_kind}) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
