"""Sequence packing vs padding (``python -m benchmarks.packing``): tokens/s on a batch of very
uneven lengths, per backend.

For every layout two Policies run side by side in one process, on the same random model
(``benchmarks.lib.sizes.SIZES``) and the same batch: one pads every row to the batch width,
the other packs the sequences into rows of at most ``--budget`` tokens
(``policy.sequence_packing``).  Their calls alternate (padded, packed, padded, ...), so both
see the same background load, and the ratio packed / padded is taken from medians of the
same run.  The batch has a quarter of its rows at full width and the rest short, so most
of a padded batch is padding: the speed-up the padded-token fraction predicts is
``1 / (1 - padded fraction)`` for the token-proportional work (projections, MLP); packed
attention runs over whole packed rows with a block-diagonal mask, so it can cost more.
Tokens/s counts real tokens only.  The logprobs of both are compared as a check.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.errors import error_text
from benchmarks.lib.layouts import parse_layout
from benchmarks.lib.models import load_tokenizer, random_llama, vocab_size
from benchmarks.lib.policy import PolicyRunner
from benchmarks.lib.ray_session import RaySession
from benchmarks.lib.sizes import SIZES

DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "jax-fsdp2"]
OPS = ("logprobs", "train")


def uneven_lengths(batch: int, seq: int, seed: int = 0) -> list[int]:
    """A quarter of the rows at full width, the others between seq/16 and seq/4 tokens."""
    import random

    rng = random.Random(seed)
    long = max(1, batch // 4)
    lengths = [seq] * long + [rng.randint(max(2, seq // 16), max(2, seq // 4)) for _ in range(batch - long)]
    rng.shuffle(lengths)
    return lengths


def uneven_batch(lengths: list[int], seq: int, vocab: int):
    """NLL batch (loss on every real token) with these lengths, right-padded to ``seq``."""
    import torch

    from core.data import BatchedDataDict

    g = torch.Generator().manual_seed(0)
    lens = torch.tensor(lengths)
    valid = torch.arange(seq)[None, :] < lens[:, None]
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=g) * valid
    return BatchedDataDict(
        input_ids=ids, input_lengths=lens, token_mask=valid.float(), sample_mask=torch.ones(len(lengths))
    )


def start_runner(name: str, model: str, tokenizer, args, packing: dict | None) -> PolicyRunner:
    run_args = argparse.Namespace(**vars(args), packing=packing, tag="-packed" if packing else "-padded")
    return PolicyRunner(name, model, model, tokenizer, run_args)


def bench_layout(name: str, model: str, tokenizer, data, args) -> dict:
    budget = {
        "enabled": True,
        "train_mb_tokens": args.budget,
        "logprob_mb_tokens": args.budget,
        "algorithm": args.algorithm,
    }
    runners = {}
    try:
        runners["padded"] = start_runner(name, model, tokenizer, args, None)
        runners["packed"] = start_runner(name, model, tokenizer, args, budget)
        for runner in runners.values():
            runner.data = data
        lp = {kind: r.policy.get_logprobs(data)["logprobs"] for kind, r in runners.items()}
        times: dict[str, dict[str, list[float]]] = {kind: {op: [] for op in OPS} for kind in runners}
        for i in range(args.warmup + args.iters):
            for op in OPS:
                for kind, runner in runners.items():
                    seconds = getattr(runner, op)()
                    if i >= args.warmup:
                        times[kind][op].append(seconds)
    finally:
        for runner in runners.values():
            runner.close()
    tokens = int(data["input_lengths"].sum())
    row = {"layout": name, "max_abs_logprob_diff": float((lp["padded"] - lp["packed"]).abs().max())}
    for op in OPS:
        pad, pack = statistics.median(times["padded"][op]), statistics.median(times["packed"][op])
        row[op] = {
            "padded_s": times["padded"][op],
            "packed_s": times["packed"][op],
            "padded_tokens_per_s": tokens / pad,
            "packed_tokens_per_s": tokens / pack,
            "speedup": pad / pack,
        }
    return row


def report(results: dict) -> str:
    lines = [
        f"Sequence packing vs padding -- {results['model']}, batch {results['batch']} x width "
        f"{results['seq']}, {results['tokens']} real tokens, padded fraction {results['padded_fraction']:.2f} "
        f"(predicts x{results['predicted_speedup']:.2f}), packing budget {results['budget']} tokens, "
        f"{results['threads']} threads per case",
        "",
        "| layout | logprobs tok/s padded | packed | x | train tok/s padded | packed | x | max |lp diff| |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["layouts"]:
        if "error" in r:
            lines.append(f"| {r['layout']} | ERROR: {r['error']} |")
            continue
        lp, tr = r["logprobs"], r["train"]
        lines.append(
            f"| {r['layout']} | {lp['padded_tokens_per_s']:.0f} | {lp['packed_tokens_per_s']:.0f} | "
            f"{lp['speedup']:.2f} | {tr['padded_tokens_per_s']:.0f} | {tr['packed_tokens_per_s']:.0f} | "
            f"{tr['speedup']:.2f} | {r['max_abs_logprob_diff']:.1e} |"
        )
    return "\n".join(lines)


def run_packing(args) -> tuple[dict, bool]:
    """Every layout on one random model and one uneven batch; the results, and whether a layout failed."""
    lengths = uneven_lengths(args.batch, args.seq)
    results = {
        "model": f"random {args.size} Llama",
        "batch": args.batch,
        "seq": args.seq,
        "budget": args.budget,
        "threads": args.threads,
        "tokens": sum(lengths),
        "lengths": lengths,
        "layouts": [],
    }
    results["padded_fraction"] = 1 - sum(lengths) / (args.batch * args.seq)
    results["predicted_speedup"] = 1 / (1 - results["padded_fraction"])
    session = RaySession(args.ray_cpus)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        model = random_llama(SIZES[args.size].shape, Path(tmp) / f"bench-{args.size}")
        tokenizer = load_tokenizer(model)
        data = uneven_batch(lengths, args.seq, vocab_size(model))
        for name in args.layouts:
            t0 = time.perf_counter()
            try:
                session.start(session.devices_for(parse_layout(name)))
                results["layouts"].append(
                    {**bench_layout(name, model, tokenizer, data, args), "wall_s": time.perf_counter() - t0}
                )
            except Exception as err:  # noqa: BLE001 - one layout's failure is reported, the rest run
                failed = True
                results["layouts"].append({"layout": name, "error": error_text(err)})
            print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return results, failed
