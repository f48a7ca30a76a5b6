"""``dualrl bench --gpu`` (``benchmarks.gpu``): every backend on one device next to plain HF eager.

In the order a run goes:

    sections.py     which rows are measured, in what order (the machine, the vLLM skips, HF, each backend, loss)
    yardstick.py    plain HF steps in a child process: the HF eager rows and the fp32 reference
    policy_rows.py  one backend's Policy: throughput, refit-source and fp32 loss rows
    workload.py     the rows, and the timing / MFU / loss-difference arithmetic
    report.py       the markdown report and the exit status
"""
