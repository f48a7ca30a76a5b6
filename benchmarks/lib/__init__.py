"""The benchmarks' one library: every ``python -m benchmarks.<name>`` / ``dualrl bench|parity`` entry
point parses its arguments, calls into here and prints.  Nothing here imports an entry point.

Shared by the benchmarks:

    layouts.py      the layout grammar (fsdp1-dp2, dtensor-tp2-sp, jax-fsdp2, ...)
    sizes.py        Size / SIZES (dualrl bench), GPU_SIZES (--gpu), GRPOWorkload
    models.py       prepare_model (a name, a path) and random_llama (a shape); tokenizer, vocab, params
    workload.py     the batches, the policy section on a layout, the default AdamW
    ray_session.py  RaySession: Ray through core.distributed.ray_init.start_ray, XLA host devices, restarts
    policy.py       PolicyCase, PolicyRunner (torch and JAX), JaxActor: a layout's Policy, timed on the driver
    hf.py           plain HF eager: hf_steps, HFRunner (a child process)
    child.py        the child-process protocol (spec on stdin, @@-prefixed JSON replies)
    pairing.py      paired timing against the HF baseline, Probe (wall and CPU seconds per call)
    refit.py        the vLLM engine, timed refits, the memcpy baseline
    grpo_step.py    dualrl's GRPO step on a layout, phase by phase
    trl.py          TRL trainers in child processes (trl_version, the step gate, TRLRunner)
    trl_grpo.py     TRL's GRPOTrainer as dualrl's GRPO step's baseline
    trl_grpo_child.py  its child process (the trainer, its patches and timers)
    roofline.py     the engines' matmul peaks on the workload's products, every phase's share of the best
    bench.py        Bench: what one dualrl bench run shares (both modes)
    machine.py      machine_facts, matmul / datasheet peaks, FLOPs per token, MFU, versions
    proc.py         /proc: CPU seconds, threads, affinity, RSS and its peak
    markdown.py     cells, tables, spreads
    errors.py       error_text: one report line for a failure

Each benchmark's own part:

    compare/        dualrl bench              (benchmarks.compare, torch_backends, jax_backend, refit)
    gpu/            dualrl bench --gpu        (benchmarks.gpu)
    parity/         dualrl parity             (benchmarks.parity)
    soak.py         benchmarks.soak
    packing.py      benchmarks.packing
    kernels.py      benchmarks.kernels
    trl_compare/    benchmarks.trl_compare    (data, the TRL child, the schedule, the report)
"""
