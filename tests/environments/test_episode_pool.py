"""Multi-turn episodes in the Ray EpisodePool: the same episodes as in-process, failures included.

Scripted episodes (tests.unit.test_multi_turn's word tokenizer and scripted engine) against
:class:`ScriptEnv`, a user environment built by import path in the pool's actors: the rows
(ids, masks, logprobs, rewards, infos with their error texts) must be equal between
``env.num_workers: 0`` (in-process) and a pool of two actors, with a step that raises, one
that returns NaN and one over the deadline among them; an actor that stops answering is
killed and replaced, and exactly its episodes end with a named error.  Slow: Ray + actors.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from core.algorithms.multi_turn import EpisodeRunner, episodes_to_rows
from core.algorithms.observation_tokens import ObservationTokens
from core.environments.episode_pool import EpisodePool, episode_executor
from core.environments.episodes import InProcessEpisodes
from core.environments.multi_turn import EpisodeError, StepResult
from tests.unit.test_multi_turn import ScriptedEngine, _tokenizer, ids

pytestmark = pytest.mark.slow

MODULE = "tests.environments.test_episode_pool"
TIMEOUT_S = 0.5


class ScriptEnv:
    """Reward 0.25 x the episode's turn count so far (so a lost state would show), done on
    'z'; 'x' raises, 'n' returns NaN, 's' sleeps past the deadline, 'k' stops the whole
    process (SIGSTOP: no thread deadline can fire, only the driver's)."""

    name = "script"

    def __init__(self, cfg):
        self.sleep_s = 4 * cfg.timeout_s

    def reset(self, metadata):
        return {"turns": 0}

    def step(self, state, message):
        state["turns"] += 1
        words = message.split()
        if "x" in words:
            raise RuntimeError("tool crashed")
        if "s" in words:
            time.sleep(self.sleep_s)
        if "k" in words:
            os.kill(os.getpid(), signal.SIGSTOP)
        reward = float("nan") if "n" in words else 0.25 * state["turns"]
        done = "z" in words
        return StepResult(None if done else "o k", reward, done, {"turns_seen": state["turns"]})


def _cfg(workers, on_error="end_episode"):
    return {"name": f"{MODULE}:ScriptEnv", "num_workers": workers, "timeout_s": TIMEOUT_S, "on_episode_error": on_error}


def _run(executor, scripts, on_error):
    """Play one episode per script (keyed by its prompt word) and return the GRPO rows."""
    tok = _tokenizer(False)
    end = tok.eos_token_id
    engine = ScriptedEngine({ids(p)[0]: [ids(t) + [end] for t in turns] for p, turns in scripts})
    obs = ObservationTokens(tok, use_chat_template=False, stop_token_ids=[end])
    runner = EpisodeRunner(executor, tok, obs, max_turns=3, max_total_tokens=64, on_error=on_error)
    prompts = [ids(p) for p, _ in scripts]
    episodes = runner.run(prompts, [{} for _ in prompts], engine, greedy=False, seed=1, step=2)
    return episodes_to_rows(episodes, tok.pad_token_id)


#: Two actors: episodes 0-2 on worker 0 (with the overrun and the raise), 3-5 on worker 1.
SCRIPTS = [
    ("a", ["b", "b", "z"]),
    ("d", ["b", "x"]),
    ("e", ["s"]),
    ("f", ["n"]),
    ("g", ["b", "b", "b"]),
    ("h", ["z"]),
]


def _assert_same_rows(left, right):
    assert left.keys() == right.keys()
    for key in left.keys():
        if isinstance(left[key], torch.Tensor):
            assert torch.equal(left[key], right[key]), key
        else:
            assert left[key] == right[key], key


@pytest.fixture(scope="module")
def pool(ray_session):
    pool = EpisodePool(_cfg(2))
    yield pool
    pool.shutdown()


def test_pool_episodes_equal_in_process_episodes_with_errors_and_an_overrun(pool):
    in_process = episode_executor(_cfg(0))
    assert isinstance(in_process, InProcessEpisodes)
    expected = _run(in_process, SCRIPTS, "end_episode")
    got = _run(pool, SCRIPTS, "end_episode")
    _assert_same_rows(expected, got)
    ended = [info["ended"] for info in got["infos"]]
    assert ended == ["done", "error", "error", "error", "max_turns", "done"]
    assert got["rewards"].tolist() == [0.25 + 0.5 + 0.75, 0.25, 0.0, 0.0, 1.5, 0.25]
    assert "episode 1, turn 1: step() raised RuntimeError: tool crashed" in got["infos"][1]["error"]
    assert f"episode 2, turn 0: step() ran past env.timeout_s={TIMEOUT_S:g} s" in got["infos"][2]["error"]
    assert "episode 3, turn 0: field 'reward' is nan" in got["infos"][3]["error"]
    # fail: the same first error (episode 2's overrun, turn 0) from both executors
    with pytest.raises(EpisodeError) as local:
        _run(in_process, SCRIPTS, "fail")
    with pytest.raises(EpisodeError) as pooled:
        _run(pool, SCRIPTS, "fail")
    assert str(pooled.value) == str(local.value) and "episode 2, turn 0" in str(pooled.value)
    # worker 0 (overrun) was replaced when each rollout ended; the pool plays on, states fresh
    _assert_same_rows(
        _run(pool, SCRIPTS[:1] + SCRIPTS[4:], "end_episode"), _run(in_process, SCRIPTS[:1] + SCRIPTS[4:], "end_episode")
    )


def test_an_actor_that_stops_answering_is_replaced_and_its_episodes_end_named(pool):
    pool.call_grace_s = 1.0
    scripts = [("a", ["k"]), ("d", ["b", "z"]), ("g", ["b", "z"]), ("h", ["b", "b", "z"])]
    start = time.perf_counter()
    rows = _run(pool, scripts, "end_episode")
    assert time.perf_counter() - start < 60
    infos = rows["infos"]
    assert [info["ended"] for info in infos] == ["error", "error", "done", "done"]
    for row in (0, 1):  # both of worker 0's episodes: the one that blocked it and the one beside it
        assert f"episode {row}, turn 0: worker 0 of the episode pool did not answer within" in infos[row]["error"]
        assert "the state of this episode is lost" in infos[row]["error"]
    assert rows["episode_errors"].tolist() == [True, True, False, False]
    assert rows["rewards"].tolist() == [0.0, 0.0, 0.75, 0.25 + 0.5 + 0.75]
    again = [("a", ["b", "z"]), ("d", ["z"]), ("g", ["b", "z"]), ("h", ["z"])]
    _assert_same_rows(_run(pool, again, "end_episode"), _run(episode_executor(_cfg(0)), again, "end_episode"))
