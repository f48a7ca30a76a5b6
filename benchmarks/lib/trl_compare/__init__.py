"""SFT and DPO steps of dualrl's layouts vs TRL's ``SFTTrainer`` / ``DPOTrainer``: the library of
``python -m benchmarks.trl_compare`` (its docstring has the methodology and the caveats).

* :mod:`.data` -- the data, built once in the driver by the project's own data path: the ids
  both sides train on;
* :mod:`.trl_child` -- the TRL child (``benchmarks.lib.trl``): a trainer, one optimizer step per
  request;
* :mod:`.run` -- :class:`~.run.DualRLRunner` (one algorithm on one layout, a Policy on a cluster
  of its own) and the schedule: every dualrl step followed by one TRL step of the same algorithm;
* :mod:`.report` -- the report.
"""

from benchmarks.lib.trl_compare.data import (
    ALGORITHMS,
    CHECK_RTOL,
    DEFAULT_LAYOUTS,
    DPO_LOSS_CFG,
    SEED,
    batch_facts,
    build_examples,
    rows,
    to_batch,
    trl_examples,
)
from benchmarks.lib.trl_compare.report import ratio, report
from benchmarks.lib.trl_compare.run import DualRLRunner, run_algorithm, run_trl_compare

__all__ = [
    "ALGORITHMS",
    "CHECK_RTOL",
    "DEFAULT_LAYOUTS",
    "DPO_LOSS_CFG",
    "SEED",
    "DualRLRunner",
    "batch_facts",
    "build_examples",
    "ratio",
    "report",
    "rows",
    "run_algorithm",
    "run_trl_compare",
    "to_batch",
    "trl_examples",
]
