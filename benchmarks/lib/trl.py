"""TRL's trainers as baselines, each in a child process of its own (``benchmarks.lib.child``).

The child builds its trainer, answers ``ready`` once the trainer starts training, and then runs
exactly one optimizer step per ``step`` line from the driver: a :func:`gate` callback holds the
trainer in ``on_step_end`` until the next line, so trainer construction and the waits are no part
of any step.  Each step's answer has its seconds (``on_step_begin`` -> ``on_step_end``) and its
``loop_s`` (the driver's go -> ``on_step_end``: also the trainer loop's between-step work and
fetching + collating the next batch).  ``quit`` (or the driver going away) ends ``train()``.

``benchmarks.lib.trl_compare`` runs ``SFTTrainer`` / ``DPOTrainer`` this way,
``benchmarks.lib.trl_grpo`` ``GRPOTrainer``.  trl is optional (``pip install -e .[bench]``):
these modules import without it, and :func:`trl_version` says ``None`` then.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from benchmarks.lib.child import Child, reply

#: The TRL child's environment: no rich console, quiet transformers ...
TRL_ENV = {"TRANSFORMERS_VERBOSITY": "error", "ACCELERATE_DISABLE_RICH": "1"}
#: ... and, unless the user says otherwise, no network (trl's trainers ping the Hub at
#: construction unless told not to; the models are local).
TRL_ENV_DEFAULTS = {"HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1"}


def trl_version() -> str | None:
    """The installed trl version, or ``None`` when trl is not importable."""
    try:
        import trl
    except Exception:  # noqa: BLE001 -- missing, or broken against this torch/transformers
        return None
    return trl.__version__


class Stop(Exception):
    """The driver said quit (or went away): leave ``trainer.train()``."""


def gate(t0: float, ready: Callable[[], dict], step_reply: Callable[[float, float], dict], reset: Callable[[], None]):
    """The callback that holds a trainer between steps until the driver says ``step``.

    ``ready()``: the facts answered once training begins (with ``startup_s`` since ``t0``);
    ``step_reply(step_s, loop_s)``: a step's answer; ``reset()``: runs before each step."""
    from transformers import TrainerCallback

    class Gate(TrainerCallback):
        def _wait(self) -> None:
            if sys.stdin.readline().strip() != "step":
                raise Stop
            self.go = time.perf_counter()
            reset()

        def on_train_begin(self, args, state, control, **kwargs):
            reply({**ready(), "startup_s": time.perf_counter() - t0})
            self._wait()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            end = time.perf_counter()
            reply(step_reply(end - self.begin, end - self.go))
            self._wait()

    return Gate()


def train_until_stopped(trainer) -> None:
    try:
        trainer.train()
    except Stop:
        pass


class TRLRunner:
    """A TRL trainer in a child process; ``step()`` = one optimizer step, its answer.

    ``startup_s``: driver-side seconds until the trainer was ready (no part of any step);
    ``ready``: the child's facts (versions, config, ...); ``threads``: ``[torch threads]`` of the
    child; ``params``: the model's parameter count."""

    name, workers = "trl", 1

    def __init__(self, target: str, spec: dict, threads: int) -> None:
        env = {**TRL_ENV_DEFAULTS, **{k: os.environ[k] for k in TRL_ENV_DEFAULTS if k in os.environ}, **TRL_ENV}
        t0 = time.perf_counter()
        self._child = Child(target, spec, threads, env=env, what="TRL")
        try:
            self.ready = self._child.reply()
        except BaseException:
            self._child.close()
            raise
        self.startup_s = time.perf_counter() - t0
        self.threads, self.params, self.pids = [self.ready["threads"]], self.ready.get("params"), [self._child.pid]

    def step(self) -> dict:
        return self._child.call("step")

    def close(self) -> None:
        self._child.close()
