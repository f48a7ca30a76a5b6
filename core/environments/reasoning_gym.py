"""reasoning-gym's procedural tasks as a built-in source of problems and as a reward.

reasoning-gym (PyPI ``reasoning-gym``, an optional extra: ``pip install 'dualrl[reasoning]'``)
generates English prompts of 100+ tasks and scores an answer with each task's own
``score_answer`` (partial credit where the task gives it).  Two parts here:

* :class:`ReasoningGymTask` -- the problems of one task or a weighted mix
  (``data.reasoning_gym``), a pure function of ``(seed, index)`` like the built-in arithmetic
  task, so that the train stream, the held-out problems and the warm start reuse the same
  machinery (core.datasets.base).  Each row carries its task's name, settings, seed and
  reasoning-gym metadata, so the scorer needs nothing else.
* :class:`ReasoningGymEnvironment` (``env.name: reasoning_gym``) -- scores a completion with
  its row's task's ``score_answer`` in the environment pool like any reward.

Why the splits never overlap: reasoning-gym draws problem ``i`` of a generator seeded ``s``
from ``Random(s + i)`` (most tasks), so the streams of two nearby seeds are the same problems
shifted by one -- different seeds alone are not different problems.  Problem ``index`` of the
run seed ``seed`` is therefore the generator's problem ``zigzag(seed) * 2**48 + index``: two
seeds own disjoint ranges of the generator's indices, whatever the generator does with them.
The train stream also skips every held-out question (core.datasets.base), which holds for
tasks whose question space is small enough to repeat across indices.

reasoning-gym is imported lazily, where a task is built: ``import core.environments`` does not
need it, and a config that names it without the package installed is refused before any
worker starts (:mod:`core.environments.reasoning_gym_checks`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from core.environments.config import ReasoningGymConfig
from core.environments.interfaces import EnvironmentReturn, RewardError, check_batch_lengths, describe_sample
from core.environments.reasoning_gym_checks import dataset, import_reasoning_gym

#: How many generator indices each run seed owns (item indices of a train stream, with its
#: rejected candidates, stay far below it: core.datasets.sources.CANDIDATE_STRIDE x 1000).
SEED_REGION = 2**48
#: A task whose training draws are at least this share held-out questions is refused: its
#: settings give too few distinct questions (the train stream would silently drop the task).
MAX_HELD_OUT_SHARE = 0.9
#: How many problems of the train seed that check draws.
HELD_OUT_CHECK_DRAWS = 256
#: The metadata columns of a reasoning-gym row (besides prompt and answer).
TASK_COLUMNS = ("task", "task_seed", "task_settings", "task_metadata")

__all__ = ["SEED_REGION", "TASK_COLUMNS", "ReasoningGymEnvironment", "ReasoningGymTask"]


# ----------------------------------------------------------------------------- problems
class ReasoningGymTask:
    """The problems of a task mix (``data.reasoning_gym``): problem ``index`` of ``seed`` is
    one task's, drawn by weight, and that task's problem in the seed's own region."""

    def __init__(self, cfg: ReasoningGymConfig | Mapping[str, Any], path: str = "data.reasoning_gym") -> None:
        self.settings = ReasoningGymConfig.coerce(cfg, path)
        self.path = path
        self.names = [task.name for task in self.settings.tasks]
        self.weights = [task.weight for task in self.settings.tasks]
        self._datasets = [dataset(t.name, t.seed, t.settings) for t in self.settings.tasks]

    def problem(self, seed: int, index: int) -> dict[str, Any]:
        """``{"prompt", "answer", "task", "task_seed", "task_settings", "task_metadata"}``."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < SEED_REGION:
            raise ValueError(f"{self.path}: problem index must be an int in [0, 2**48), got {index!r}")
        # A string seed goes through SHA-512 (random.seed version 2): the same draw in every process.
        k = random.Random(f"reasoning_gym:{seed}:{index}").choices(range(len(self.names)), self.weights)[0]
        task = self.settings.tasks[k]
        entry = self._datasets[k][_zigzag(seed) * SEED_REGION + index]
        return {
            "prompt": entry["question"],
            "answer": entry["answer"],
            "task": task.name,
            "task_seed": task.seed,
            "task_settings": dict(task.settings),
            "task_metadata": entry.get("metadata", {}),
        }

    def problems(self, seed: int, start: int, count: int) -> list[dict[str, Any]]:
        """Problems ``start .. start+count-1`` of ``seed``."""
        return [self.problem(seed, start + i) for i in range(count)]

    def check_train_space(self, seed: int, held_out: frozenset[str], num_val_key: str) -> None:
        """Refuse a task whose questions the held-out ones (nearly) exhaust: the train stream
        skips held-out questions, so such a task would vanish from training without a word."""
        drawn = {name: [0, 0] for name in self.names}
        for problem in self.problems(seed, 0, HELD_OUT_CHECK_DRAWS):
            counts = drawn[problem["task"]]
            counts[0] += problem["prompt"] in held_out
            counts[1] += 1
        for k, (task, (held, total)) in enumerate(zip(self.settings.tasks, drawn.values(), strict=True)):
            if total and held >= MAX_HELD_OUT_SHARE * total:
                raise ValueError(
                    f"{self.path}.tasks[{k}] ({task.name}): {held} of the {total} training questions drawn "
                    f"are held-out ones: its settings {dict(task.settings)} give too few distinct questions "
                    f"to hold {num_val_key} out and train on the rest; widen them or lower {num_val_key}"
                )


def _zigzag(seed: int) -> int:
    """0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ...: every int seed its own region."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return 2 * seed if seed >= 0 else -2 * seed - 1


# ----------------------------------------------------------------------------- the reward
class ReasoningGymEnvironment:
    """Reward = the row's task's ``score_answer(completion.strip(), entry)`` in [0, 1] (partial
    credit kept); ``info``: ``correct`` (full credit), the ``answer`` read (the stripped
    completion, what maj@k votes on) and the ``task`` (per-task metrics)."""

    name = "reasoning_gym"

    def __init__(self, cfg: Any = None) -> None:
        import_reasoning_gym()  # fail at the pool's start-up, not at the first score
        self._scorers: dict[str, Any] = {}

    def score(self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        check_batch_lengths(prompts, completions, metadata)
        rewards: list[float] = []
        infos: list[dict[str, Any]] = []
        for i, (prompt, completion, meta) in enumerate(zip(prompts, completions, metadata, strict=True)):
            task, entry = self._entry(meta, i, prompt, completion)
            answer = str(completion).strip()
            reward = float(self._scorer(task, meta).score_answer(answer, entry))
            rewards.append(reward)
            infos.append({"correct": reward == 1.0, "extracted": answer or None, "answer": answer, "task": task})
        return EnvironmentReturn(rewards=rewards, infos=infos)

    def _entry(self, meta: Any, i: int, prompt: str, completion: str) -> tuple[str, dict[str, Any]]:
        missing = [key for key in (*TASK_COLUMNS, "ground_truth", "raw_prompt") if key not in meta]
        if missing:
            raise RewardError(
                f"environment 'reasoning_gym': {describe_sample(i, prompt, completion)}: metadata lacks {missing} "
                "(rows come from data.dataset_name: reasoning_gym)"
            )
        entry = {"question": meta["raw_prompt"], "answer": str(meta["ground_truth"]), "metadata": meta["task_metadata"]}
        return meta["task"], entry

    def _scorer(self, task: str, meta: Mapping[str, Any]) -> Any:
        """The task's generator built with the row's settings (some scorers read their config)."""
        key = json.dumps([task, meta["task_seed"], meta["task_settings"]], sort_keys=True, default=str)
        if key not in self._scorers:
            self._scorers[key] = dataset(task, meta["task_seed"], meta["task_settings"])
        return self._scorers[key]
