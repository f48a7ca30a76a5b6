"""``dualrl bench`` (``benchmarks.compare``): every layout on one workload, measured in one run.

run.py        the run: Ray, the model, the baselines, every layout in turn (throughput, refit, GRPO step)
baselines.py  what every layout is paired with: HF eager, TRL's GRPOTrainer, the vLLM engine
report.py     the markdown tables
plot.py       bench.png
"""
