"""``dualrl bench --gpu``: every backend on one device next to plain HF eager, in one run.

    dualrl bench --gpu [--size 1b|tiny] [--backends B ...] [--mbs M ...] [--sections throughput refit loss]
        [--device auto|cuda|cpu] [--hf-compile] [--peak-tflops T] [--no-vllm] [--json PATH] [--model-dir DIR]
    python -m benchmarks.gpu [same]

The workload (GitHub issue 14): a Llama with random weights built locally from a config
(``--size 1b``, the default on a GPU: Llama-3.2-1B's shape, bf16 compute over fp32 master weights, 8 sequences x 2048
tokens; ``--size tiny``, the default on a CPU: a smoke, fp32, 4 x 64), every row full length (no padding), NLL loss,
the default AdamW of ``core/configs/policy.yaml``.  One :class:`core.policy.Policy` per backend
(``torch_fsdp``, ``torch_dtensor``, ``torch_dtensor-compiled`` -- ``dtensor_cfg.compile`` on, by
default only on a GPU --, ``jax_pjit``) on one bundle of one GPU (or of ``--threads`` CPUs)
through Ray, one backend alive at a time.  Sections:

* **throughput**, per backend and micro batch size (``--mbs``): ``get_logprobs`` and ``train``
  (one optimizer step over the whole batch per call) tokens/s = ``batch x seq`` / the median
  wall seconds of ``--iters`` calls on the driver (Ray dispatch included; the results come back
  through Ray, so the device has finished when the clock is read), after ``--warmup`` untimed
  calls (JAX compiles in the first: its seconds are shown as "first s").  ×HF = tokens/s over
  HF eager's at the same micro batch.  MFU = tokens/s x model FLOPs per token / the peak:
  forward ``2 N + 4 L S d`` FLOPs per token (``N`` matmul weights incl. the LM head, ``L``
  layers, ``S`` sequence, ``d`` hidden: attention's two ``[S, S]`` products, not halved for the
  causal mask), train 3x that (``6 N + 12 L S d``) -- ``benchmarks.machine.flops_per_token``.
  The peak is the datasheet's dense bf16 tensor-core figure of a known GPU (H100 / H200 989,
  A100 312 TFLOP/s), or ``--peak-tflops``; MFU is n/a on a CPU, an unknown GPU, or in fp32
  (whose matmuls run at ``highest`` precision, a peak no table here gives).  Peak memory per
  backend and micro batch: the workers' peak allocated bytes (torch: ``max_memory_allocated``
  after ``reset_peak_memory_stats``; JAX: ``memory_stats()['peak_bytes_in_use']``, which XLA
  cannot reset, so it is the process's peak so far); on a CPU the process's peak RSS.
* The yardstick (=1.00): plain ``AutoModelForCausalLM`` in a child process of its own (its
  device memory freed before any Policy starts), same model, batch and micro batches, bf16
  autocast when ``--precision bfloat16``, the same AdamW kwargs and grad-norm clip, timed in
  the child between device synchronisations.  ``--hf-compile`` adds a second yardstick row:
  every decoder block ``torch.compile``-d and ``AdamW(fused=True)``.
* **refit**: the source side of a refit without an engine: ``prepare_refit_info`` seconds, then
  the whole weight stream (``prepare_weights_for_ipc``, ``get_weights_ipc_handles`` per bucket,
  ``finish_refit_stream``: gathers, cast to the engine dtype, CUDA IPC handles on a GPU /
  shared-memory segments on a CPU), seconds and GB/s.  Refit *into* a vLLM engine and vLLM
  generation are printed as skipped with the reason: this mode holds one device for the
  policy, and without vLLM (or with ``--no-vllm``) there is no engine at all.
* **loss**: fp32 loss curves: ``--check-steps`` (5) ``train`` calls per backend on a fresh fp32
  Policy (constant lr ``--check-lr``, micro batch ``--check-mbs``) vs a plain-torch reference in a
  child process (HF model, fp32, ``highest`` matmul precision, the same loss normalisation,
  clip and AdamW); max over steps of ``|a - b| / max(1, |a|, |b|)``, pass if ``<= --loss-tol``
  (1e-5, the issue's bar).

Output: the machine line (``benchmarks.machine``), one markdown table per section, skip notes,
and ``--json PATH``: one JSON object per line, appended as each row is measured (a run killed
by a time limit keeps what it measured).  Exit code 1 when a row failed or a loss check did not
pass.  Numbers for docs/benchmarks-and-parity.md come from running this on a GPU machine, not from tests.
"""

# The package, in the order a run goes:
#   cli.py          the flags, the device, main()
#   sections.py     which rows are measured, in what order (the vLLM skips, HF, each backend, loss)
#   bench.py        what one run shares (Bench), the random model, the machine facts, Ray
#   yardstick.py    plain HF steps in a child process: the HF eager rows and the fp32 reference
#   policy_rows.py  one backend's Policy: throughput, refit-source and fp32 loss rows
#   workload.py     sizes, the batch, the AdamW, and the timing / MFU / loss-difference arithmetic
#   report.py       the markdown report and the exit status

from benchmarks.gpu.cli import main

__all__ = ["main"]
