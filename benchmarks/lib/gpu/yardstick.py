"""The yardstick of ``dualrl bench --gpu``: plain HF ``AutoModelForCausalLM`` steps, run in a child
process of their own (``python -m benchmarks.gpu --child SPEC``) so that its device memory is gone
before any Policy starts.  The child answers the device's facts, the HF eager rows, or the
plain-torch fp32 loss curve the backends are held to, one ``@@``-prefixed JSON line each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks import machine
from benchmarks import torch_backends as tb
from benchmarks.gpu.workload import full_batch, optimizer_kwargs, timing

#: The JSON line a child process answers with starts with this.
REPLY = "@@"


def make_steps(model, ids, mbs: int, bf16: bool, opt_kwargs: dict, max_grad_norm: float | None) -> dict:
    """Plain HF ``logprobs`` (no-grad forward + log_softmax/gather) and ``train`` (token-mean NLL
    over the whole batch, accumulated over micro batches of ``mbs`` rows, clip, AdamW) steps;
    ``train`` returns (loss, pre-clip grad norm) as tensors (no host sync inside)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), **opt_kwargs)
    chunks = [ids[i : i + mbs] for i in range(0, ids.shape[0], mbs)]
    total = ids.shape[0] * (ids.shape[1] - 1)  # every next-token target is valid (full rows)

    def next_token_logprobs(x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x, use_cache=False).logits
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None])[..., 0]

    def logprobs():
        model.eval()
        with torch.no_grad():
            return [next_token_logprobs(x) for x in chunks]

    def train():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for x in chunks:
            part = -next_token_logprobs(x).sum() / total
            part.backward()
            loss = loss + part.detach()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = (
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            if max_grad_norm is not None
            else torch.nn.utils.get_total_norm([p.grad for p in params])
        )
        optimizer.step()
        return loss, norm

    return {"logprobs": logprobs, "train": train}


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # "5" resets VmHWM (Linux >= 4.0), as the torch workers do on a CPU
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _peak(device) -> tuple[int | None, str]:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "device"
    return machine.peak_rss_bytes(os.getpid()), "rss"


def measure_hf(model, ids, mbs: int, spec: dict, device) -> dict:
    """One yardstick row: ``warmup`` + ``iters`` calls per operation, each between syncs."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps = make_steps(
        model,
        ids,
        mbs,
        spec["precision"] == "bfloat16",
        optimizer_kwargs(fused=spec["fused"]),
        tb.default_policy_section()["max_grad_norm"],
    )
    _reset_peak(device)
    row: dict[str, Any] = {"mbs": mbs, "losses": []}
    for op in ("logprobs", "train"):
        seconds = []
        for _ in range(spec["warmup"] + spec["iters"]):
            sync()
            t0 = time.perf_counter()
            out = steps[op]()
            sync()
            seconds.append(time.perf_counter() - t0)
            if op == "train":
                row["losses"].append(float(out[0]))
        row[op] = timing(seconds, spec["warmup"])
    row["peak_bytes"], row["memory"] = _peak(device)
    return row


def reference_curve(model, ids, spec: dict) -> dict:
    """The plain-torch fp32 loss curve the backends are held to."""
    steps = make_steps(
        model, ids, spec["mbs"][0], False, optimizer_kwargs(lr=spec["lr"]), tb.default_policy_section()["max_grad_norm"]
    )
    out = [steps["train"]() for _ in range(spec["steps"])]
    return {"losses": [float(loss) for loss, _ in out], "grad_norms": [float(norm) for _, norm in out]}


def child_main(spec: dict) -> None:
    """A child process: the device's facts ("machine"), the HF yardstick ("hf") or the fp32
    reference ("reference"); each result is one ``@@``-prefixed JSON line on stdout."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    if spec["kind"] == "machine":  # the matmul peak in the benchmark's dtype: context for MFU
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine.cpu_model()
        tflops = machine.measured_matmul_tflops(device.type, spec["precision"], spec["threads"])
        print(REPLY + json.dumps({"device_name": name, "matmul_tflops": tflops}), flush=True)
        return
    if spec["kind"] == "reference":  # fp32 means fp32: no TF32 (as policy.matmul_precision "highest")
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(device)
    if spec.get("compile"):
        for block in model.model.layers:
            block.compile()
    ids = full_batch(spec["batch"], spec["seq"], model.config.vocab_size)["input_ids"].to(device)
    if spec["kind"] == "reference":
        print(REPLY + json.dumps(reference_curve(model, ids, spec)), flush=True)
        return
    print(
        REPLY
        + json.dumps({"attn_implementation": model.config._attn_implementation, "threads": torch.get_num_threads()}),
        flush=True,
    )
    for mbs in spec["mbs"]:
        try:
            row = measure_hf(model, ids, mbs, spec, device)
        except Exception as err:  # noqa: BLE001 -- e.g. out of memory at this micro batch: the next still runs
            traceback.print_exc()
            row = {"mbs": mbs, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
        print(REPLY + json.dumps(row), flush=True)


def run_child(spec: dict, threads: int, on_reply: Callable[[dict], None] = lambda r: None) -> list[dict]:
    """Run :func:`child_main` in a fresh process (its device memory is gone when it exits);
    its JSON replies in order, each also passed to ``on_reply`` as it arrives.  Raises with
    the child's stderr tail when it fails."""
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--child", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    replies = []
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for line in proc.stdout:
            if line.startswith(REPLY):
                replies.append(json.loads(line[len(REPLY) :]))
                on_reply(replies[-1])
        if proc.wait() != 0:
            err.seek(0)
            raise RuntimeError(
                f"{spec['kind']} child exited with rc {proc.returncode} after {len(replies)} "
                f"replies:\n{err.read()[-3000:]}"
            )
    return replies
