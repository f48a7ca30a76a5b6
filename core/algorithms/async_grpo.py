"""Async GRPO: the engines generate the next steps' rollouts while the policy trains.

Two threads share the run.  The *producer* (:class:`RolloutProducer`) runs
``generate_rollout`` for steps first..last in order -- prompts, sampling, rewards,
advantages -- on the vLLM engines, which have devices of their own
(``policy.generation.colocated.enabled: false``, weights by ``collective`` broadcast).  The
*trainer* (the loop's thread, :func:`async_grpo_step`) trains on each step's rollouts as they
arrive and then moves the engines to the new weights.

The schedule is fixed, so a run is reproducible (NeMo RL's target weight versions, made
deterministic): with ``m = grpo.async_grpo.max_trajectory_age_steps`` the rollouts of step k
are generated with the weights of step ``max(start, k - 1 - m)`` -- ``start`` is the step the
run started (or resumed) from -- and trained on by the policy of step ``k - 1``: their age is
at most ``m``.  The producer waits for those weights; the trainer refits the engines to step
``v``'s weights only once every rollout meant to come from an older version (steps up to
``v + m``) has been generated.  So nothing is ever too old to train on, nothing is dropped or
generated twice, and ``m = 0`` is exactly the synchronous loop (same rollouts, same metrics).
The gap between the generating and the trained policy is corrected by the loss's importance
weights (``loss_fn.use_importance_sampling_correction``, required unless
``allow_uncorrected_off_policy``).

Refits and generate calls hold the rollout engine's lock: a refit lands between two requests,
never inside one, and each rollout is tagged with the exact weights that produced it.

Checkpoints save the trainer's state (weights, optimizer, the prompt position of the last
*trained* step); rollouts generated ahead are not saved but regenerated on ``--resume`` with
the checkpoint's weights, so a resumed run continues the uninterrupted one exactly only with
``m = 0`` (with ``m > 0`` its first ``m`` steps train on fresher rollouts).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from core.algorithms.grpo import Rollout, generate_rollout, train_on_rollout
from core.algorithms.timing import StepTimer

if TYPE_CHECKING:
    from core.algorithms.grpo_run import GRPORun

#: How often a waiting thread re-checks for a stop or an error of the other one (seconds).
_POLL_S = 1.0


class RolloutProducerError(RuntimeError):
    """The generation thread failed; ``__cause__`` is its exception (e.g. ``EngineDeadError``)."""


class RolloutProducer:
    """The generation thread: ``generate_rollout`` for each step, as the schedule allows."""

    def __init__(self, run: GRPORun, first_step: int, last_step: int, max_age: int) -> None:
        self.run, self.first_step, self.last_step, self.max_age = run, first_step, last_step, max_age
        self.start_version = first_step - 1
        self._cond = threading.Condition()
        self._ready: dict[int, Rollout] = {}
        self._produced = first_step - 1  # the last step whose rollouts exist
        self._error: BaseException | None = None
        self._stopped = False
        self._gate_wait_s = 0.0  # the engines' idle time: waiting for the weights a step needs
        self._thread = threading.Thread(target=self._run, name="dualrl-rollout-producer", daemon=True)

    def target_version(self, step: int) -> int:
        """The training step whose weights generate step ``step``'s rollouts."""
        return max(self.start_version, step - 1 - self.max_age)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop after the current generate call; waits for it up to ``timeout_s``."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ producer thread
    def _run(self) -> None:
        try:
            for step in range(self.first_step, self.last_step + 1):
                if not self._wait_for_weights(self.target_version(step)):
                    return
                rollout = generate_rollout(self.run, step)
                with self._cond:
                    self._ready[step] = rollout
                    self._produced = step
                    self._cond.notify_all()
        except BaseException as err:  # handed to the trainer, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _wait_for_weights(self, version: int) -> bool:
        """Until the engines hold the weights of step ``version`` (False: stopped)."""
        start = time.perf_counter()
        with self._cond:
            while not self._stopped and not (self.run.engine.loaded and self.run.engine.version >= version):
                self._cond.wait(_POLL_S)
            self._gate_wait_s += time.perf_counter() - start
            return not self._stopped

    # ------------------------------------------------------------------ trainer side
    def take(self, step: int) -> tuple[Rollout, int]:
        """Step ``step``'s rollouts (waiting for them) and how many steps' rollouts were
        ready at that moment, this one included."""
        with self._cond:
            while step not in self._ready:
                self._raise_if_failed()
                self._cond.wait(_POLL_S)
            fill = len(self._ready)
            return self._ready.pop(step), fill

    def wait_generated(self, step: int) -> None:
        """Until the rollouts of every step up to ``step`` (within the run) are generated."""
        step = min(step, self.last_step)
        with self._cond:
            while self._produced < step:
                self._raise_if_failed()
                self._cond.wait(_POLL_S)

    def weights_changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def engine_idle_s(self) -> float:
        with self._cond:
            return self._gate_wait_s

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RolloutProducerError(f"the rollout generation thread failed: {self._error}") from self._error
        if not self._thread.is_alive() and not self._stopped:
            raise RolloutProducerError("the rollout generation thread ended without the rollouts asked for")


class AsyncGRPO:
    """The trainer's side of one async run: the producer, the constrained refits, the metrics
    (the async :class:`core.algorithms.grpo_run.StepSchedule`)."""

    def __init__(self, run: GRPORun, first_step: int, last_step: int, max_age: int) -> None:
        self.run, self.max_age = run, max_age
        run.engine.allow_stale = True
        self.producer = RolloutProducer(run, first_step, last_step, max_age)
        self._engine_idle_seen = 0.0

    def start(self) -> None:
        self.producer.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        self.producer.stop(timeout_s)

    def sync_weights(self) -> dict[str, float]:
        """Move the engines to the policy's current weights (step ``v``) once every rollout
        meant to come from older weights -- those of steps up to ``v + m`` -- is generated."""
        rollouts = self.run.engine
        if rollouts.loaded:
            self.producer.wait_generated(rollouts.policy_version + self.max_age)
        metrics = rollouts.sync_weights()
        self.producer.weights_changed()
        return metrics

    def step(self, step: int) -> dict[str, float]:
        """One training step: refit the engines, take this step's rollouts, train on them."""
        timer = StepTimer()
        with timer("wait_refit"):
            refit = self.sync_weights()
        with timer("wait_rollouts"):
            rollout, fill = self.producer.take(step)
        # The producer's generation and reward seconds overlap the trainer's: reported apart,
        # so that the step's timing/* phases (which plots stack) still add up to the step.
        produced = {k.replace("timing/", "async/"): v for k, v in rollout.metrics.items()}
        metrics = {**produced, **refit, **train_on_rollout(self.run, rollout, step, timer)}
        self.run.trained_loader_state = rollout.loader_state
        metrics.update(self._async_metrics(step, rollout, fill, timer, metrics))
        metrics.update(timer.metrics())
        return metrics

    def _async_metrics(
        self, step: int, rollout: Rollout, fill: int, timer: StepTimer, trained: dict[str, float]
    ) -> dict[str, float]:
        # Every sample of a step comes from one generate call, so one age covers the step.
        age = step - 1 - rollout.version
        idle = self.producer.engine_idle_s()
        engine_idle, self._engine_idle_seen = idle - self._engine_idle_seen, idle
        refit_s = timer.seconds.get("wait_refit", 0.0)
        return {
            "async/trajectory_age_mean": float(age),
            "async/trajectory_age_max": float(age),
            "async/weight_version": float(rollout.version),
            "async/buffer_fill": float(fill),
            "async/trainer_idle_s": timer.seconds.get("wait_rollouts", 0.0) + refit_s,
            "async/engine_idle_s": engine_idle,
            # engine vs trained policy on the step's tokens, by how old the engine's weights were
            f"token_mult_prob_error/age_{age}": trained.get("token_mult_prob_error", float("nan")),
        }


def async_grpo_loop(run: GRPORun, first_step: int, last_step: int) -> AsyncGRPO:
    """The schedule of an async run over steps ``first_step..last_step``, its producer started
    now and stopped with the run."""
    scheduler = AsyncGRPO(run, first_step, last_step, run.cfg.grpo.async_grpo.max_trajectory_age_steps)
    run._exit.callback(scheduler.stop)  # before the engines shut down (callbacks run last-in first)
    scheduler.start()
    return scheduler
