"""Plain HF eager, the baseline every Policy is measured against (×HF), in a child process of its own.

* :func:`hf_steps`: ``AutoModelForCausalLM`` steps -- logprobs = a no-grad forward per micro
  batch + ``log_softmax``/``gather``; train = forward + token-mean NLL over the whole batch
  (accumulated over micro batches, as the workers' global normaliser) + backward + grad-norm
  clip + AdamW step -- with the optimizer kwargs and ``max_grad_norm`` of
  ``core/configs/default.yaml``; bf16 = autocast over fp32 weights (the workers compute in
  bf16 under FSDP mixed precision).  ``dualrl bench --gpu``'s yardstick and fp32 reference
  (``benchmarks.lib.gpu.yardstick``) run the same steps.
* :class:`HFRunner`: ``dualrl bench``'s ``hf`` case, a child (``benchmarks.lib.child``) that
  loads the model once and then times one ``logprobs`` / ``train`` call per request, between
  device synchronisations (pure compute: its threads and memory are its alone).  With
  ``torch.set_num_threads(T)`` it uses the same thread budget as every Policy case, the
  workers' kernel choice (fused AdamW on CUDA unless the config says otherwise) and the
  float32 matmul precision of ``policy.matmul_precision`` (no TF32 in fp32).
"""

from __future__ import annotations

import sys
import time
import types

from benchmarks.lib.child import Child, reply
from benchmarks.lib.workload import default_policy_section, make_batch


def hf_steps(model, data, micro: int | None, bf16: bool, opt_kwargs: dict, max_grad_norm: float | None) -> dict:
    """``{"logprobs": fn, "train": fn}`` over micro batches of ``micro`` rows (None: the whole
    batch); ``train`` returns (loss, pre-clip grad norm) as tensors (no host sync inside)."""
    import torch

    device = next(model.parameters()).device
    data = data.to(device)
    ids = data["input_ids"]
    # Full rows need no attention mask: HF then stays on its plain causal path (the GPU yardstick).
    full = bool((data["input_lengths"] == ids.shape[1]).all())
    positions = torch.arange(ids.shape[1], device=device)[None, :]
    mask = None if full else (positions < data["input_lengths"][:, None]).long()
    token_mask = data["token_mask"][:, 1:]
    total = token_mask.sum()  # the whole batch's token count: micro batches add up to its mean
    optimizer = torch.optim.AdamW(model.parameters(), **opt_kwargs)
    rows = ids.shape[0]
    chunks = [slice(i, i + (micro or rows)) for i in range(0, rows, micro or rows)]

    def next_token_logprobs(part: slice):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            part_mask = None if mask is None else mask[part]
            logits = model(input_ids=ids[part], attention_mask=part_mask, use_cache=False).logits
        return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[part, 1:, None])[..., 0]

    def logprobs():
        model.eval()
        with torch.no_grad():
            return [next_token_logprobs(part) * token_mask[part] for part in chunks]

    def train():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for part in chunks:
            piece = -(next_token_logprobs(part) * token_mask[part]).sum() / total
            piece.backward()
            loss = loss + piece.detach()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = (
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            if max_grad_norm is not None
            else torch.nn.utils.get_total_norm([p.grad for p in params])
        )
        optimizer.step()
        return loss, norm

    return {"logprobs": logprobs, "train": train}


def serve_hf(spec: dict) -> None:
    """The child of :class:`HFRunner`: load the model, then answer ``logprobs`` / ``train`` lines
    on stdin with the seconds each call took (and on a GPU its peak allocated bytes) until ``quit``."""
    import torch
    from transformers import AutoModelForCausalLM

    from backends.torch_common.optim import with_default_kernel
    from backends.torch_common.precision import apply_matmul_precision

    torch.set_num_threads(spec["threads"])
    cfg = {**default_policy_section(), "precision": spec["precision"]}
    # the rule reads the typed policy section's two fields; this child has the raw YAML's
    precision = types.SimpleNamespace(matmul_precision=cfg.get("matmul_precision"), precision=cfg["precision"])
    apply_matmul_precision(precision)
    device = torch.device(spec["device"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(device)
    data = make_batch(spec["batch"], spec["seq"], model.config.vocab_size)
    opt_kwargs = with_default_kernel(torch.optim.AdamW, cfg["optimizer"]["kwargs"], device.type)
    steps = hf_steps(model, data, spec["micro"], spec["precision"] == "bfloat16", opt_kwargs, cfg["max_grad_norm"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reply({"threads": torch.get_num_threads(), "params": sum(p.numel() for p in model.parameters())})
    for line in sys.stdin:
        op = line.strip()
        if op == "quit":
            break
        sync()
        t0 = time.perf_counter()
        steps[op]()
        sync()
        out = {"seconds": time.perf_counter() - t0}
        if device.type == "cuda":
            out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        reply(out)


class HFRunner:
    """The ``hf`` case: a :func:`serve_hf` child, timed by itself (pure compute)."""

    name, workers = "hf", 1

    def __init__(self, model_path: str, args) -> None:
        spec = {
            "model": model_path,
            "batch": args.batch,
            "seq": args.seq,
            "precision": args.precision,
            "threads": args.threads,
            "device": getattr(args, "device", "cpu"),
            "micro": getattr(args, "micro", None),
        }
        t0 = time.perf_counter()
        self._child = Child("benchmarks.lib.hf:serve_hf", spec, args.threads, what="hf")
        try:
            ready = self._child.reply()
        except BaseException:
            self._child.close()
            raise
        self.startup_s = time.perf_counter() - t0
        self.threads, self.params, self.pids = [ready["threads"]], ready["params"], [self._child.pid]
        self.last_reply: dict = {}

    def _call(self, op: str) -> float:
        self.last_reply = self._child.call(op)  # on a GPU also its peak allocated bytes
        return self.last_reply["seconds"]

    def logprobs(self) -> float:
        return self._call("logprobs")

    def train(self) -> float:
        return self._call("train")

    def close(self) -> None:
        self._child.close()
