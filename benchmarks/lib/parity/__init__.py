"""``dualrl parity`` (``benchmarks.parity``, whose docstring describes every check): the library.

In the order a run goes:

    run.py           run_parity: every layout started, measured, cross-loaded and closed
    models.py        the run's arguments and layout names checked against the machine; its policy settings
    runners.py       the Policies measured (benchmarks.lib.policy.PolicyRunner with the parity settings)
    measure.py       logprobs, batch invariance, NLL steps, the step after a load
    grpo.py          GRPO step 0 on a layout and on HF
    estimators.py    the estimator rows (Dr. GRPO with its constant normaliser, RLOO) on a layout and on HF
    hf_reference.py  the HF references in this process (hf; hf-lora for -lora layouts)
    engine.py        the vLLM token_mult_prob_error check
    checks.py        measurements -> pass/fail checks and the results
    report.py        the text report
    settings.py      steps, seeds, the LoRA settings and the tolerances of every check
"""
