"""The multi-turn GRPO step of a parity run (``grpo_multi_turn_step0``): the same tool-use
episodes trained on by every layout and by ``hf``.

The episodes come from the code path training uses, driven by a scripted "engine" instead of
sampling: :class:`core.algorithms.multi_turn.EpisodeRunner` plays 8 conversations (4 problems x
2, of 1-3 assistant turns: calculator calls, an unknown tool, right and wrong final answers)
against the real built-in ``tool_arithmetic`` :class:`~core.environments.tools.ToolEnvironment`;
each turn's generated ids are the scripted text's ids plus the stop token, their logprobs the
measured policy's own ``get_logprobs`` (what an engine refit from it would sample with);
observations are the environment's tool responses, tokenized by
:class:`~core.algorithms.observation_tokens.ObservationTokens`; rows, rewards and
``token_mask`` come from ``episodes_to_rows``, advantages and the loss input from
``core.algorithms.grpo.training_data`` with ``core/configs/grpo_tool_arithmetic.yaml``'s
``grpo`` section (2 generations per prompt).  Then, as the real step does, old log-probs from
the policy, reference log-probs from the reference model, one ``train`` call of ``GRPO_STEPS``
optimizer steps (``ClippedPGLossFn``), and ``get_logprobs`` of the updated weights.

Tokenizer: the parity run's tiny word-level tokenizer has no word for a tool call, so the
episodes use a word-level tokenizer of the same kind whose vocabulary is the episodes' own
words (a whole JSON call is one word; ids below 64, inside any parity model's vocabulary).
The model is the run's.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.lib.parity.grpo import grpo_loss_fn, grpo_step0_policy

#: The workload's specials (ids 0-3, as core.testing's tiny tokenizer).
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
#: What the tool's responses are wrapped in (core.environments.tools.tool_response); one word each.
RESPONSE_WORDS = ("<tool_response>", "</tool_response>")
#: Episode rows per problem (``grpo.num_generations_per_prompt``).
GROUP = 2
#: The longest episode, in assistant turns (``grpo.max_rollout_turns``).
MAX_TURNS = 3
#: The exact per-row data compared bitwise across layouts.
EXACT_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask", "advantages", "rewards", "turns")


def call(expression: str, tool: str = "calculator") -> str:
    """A Hermes tool call as one whitespace-free JSON word between the tags."""
    return f'<tool_call> {{"name":"{tool}","arguments":{{"expression":"{expression}"}}}} </tool_call>'


#: (problem, ground truth, the assistant turns of each of its GROUP episodes).
SCRIPTS: tuple[tuple[str, str, tuple[tuple[str, ...], ...]], ...] = (
    ("23*47+5", "1086", ((call("23*47+5"), "1086"), ("1000",))),
    (
        "12+345*2",
        "702",
        ((call("345*2"), call("12+690"), "702"), ('<tool_call> {"name":"search"} </tool_call>', "702")),
    ),
    ("99*99-1", "9800", ((call("99*99-1"), "9800"), (call("99*99-1"), "9801"))),
    ("7*8*9", "504", ((call("7*8*9"), "504"), ("504",))),
)


def workload_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over the scripts' words and the calculator's
    results (whitespace splits words, decoding joins them with spaces: a scripted turn decodes
    to its own text); anything else, e.g. an error message's words, is ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from core.environments.tools import calculate

    words = {"="}
    for problem, truth, episodes in SCRIPTS:
        words.update((problem, truth))
        for turn in (turn for turns in episodes for turn in turns):
            words.update(turn.split())
            # the calculator's responses, so the observations carry the numbers, not <unk>
            words.update(str(calculate(e)) for e in re.findall(r'"expression":"([^"]+)"', turn))
    vocab = {w: i for i, w in enumerate(SPECIALS + RESPONSE_WORDS + tuple(sorted(words - set(SPECIALS))))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


LogprobsFn = Callable[[Any, Any], Any]
"""``(input_ids [B, S], input_lengths [B]) -> logprobs [B, S]`` in the ``get_logprobs`` layout."""


class ScriptedEngine:
    """A ``GenerateFn`` that "generates" each live episode's next scripted turn (its ids and
    the stop token), with the logprobs ``logprobs`` gives those tokens in context.  Turn t's
    live episodes are those whose script has more than t turns (every scripted turn before
    the last calls a tool, so the environment ends an episode exactly at its last turn)."""

    def __init__(
        self,
        tokenizer,
        turns: list[tuple[str, ...]],
        prompts: list[list[int]],
        logprobs: LogprobsFn,
        max_total_tokens: int,
    ) -> None:
        self.tokenizer, self.turns, self.prompts, self.logprobs = tokenizer, turns, prompts, logprobs
        self.max_total_tokens = max_total_tokens
        self.turn = 0

    def ids(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if self.tokenizer.decode(ids, skip_special_tokens=True) != text:  # the env must read what was scripted
            raise ValueError(f"grpo_multi_turn_step0: the workload tokenizer does not round-trip {text!r}")
        return [*ids, self.tokenizer.eos_token_id]

    def __call__(self, batch, greedy: bool):
        import torch

        from core.data import BatchedDataDict

        live = [r for r, turns in enumerate(self.turns) if len(turns) > self.turn]
        if batch.size != len(live):
            raise ValueError(
                f"grpo_multi_turn_step0: turn {self.turn}: {batch.size} live episodes, scripted {len(live)} ({live}): "
                f"an episode ended before its last scripted turn (cut by --seq {self.max_total_tokens}?)"
            )
        rows = []
        for j, r in enumerate(live):
            context = batch["input_ids"][j, : int(batch["input_lengths"][j])].tolist()
            if context[: len(self.prompts[r])] != self.prompts[r]:
                raise ValueError(f"grpo_multi_turn_step0: turn {self.turn}: row {j} is not episode {r}")
            gen = self.ids(self.turns[r][self.turn])
            if len(context) + len(gen) > self.max_total_tokens:  # an engine would cut the turn short
                raise ValueError(
                    f"grpo_multi_turn_step0: episode {r}, turn {self.turn}: the scripted turn does not fit "
                    f"within {self.max_total_tokens} tokens (--seq)"
                )
            rows.append((context, gen))
        self.turn += 1
        width = max(len(c) + len(g) for c, g in rows)
        ids = torch.full((len(rows), width), int(self.tokenizer.pad_token_id), dtype=torch.long)
        for b, (context, gen) in enumerate(rows):
            ids[b, : len(context) + len(gen)] = torch.tensor(context + gen)
        lengths = torch.tensor([len(c) + len(g) for c, g in rows])
        generated = torch.zeros_like(ids, dtype=torch.float32)
        for b, (context, gen) in enumerate(rows):
            generated[b, len(context) : len(context) + len(gen)] = 1.0
        logprobs = self.logprobs(ids, lengths).float() * generated
        return BatchedDataDict(
            output_ids=ids,
            logprobs=logprobs,
            generation_lengths=torch.tensor([len(g) for _, g in rows]),
            unpadded_sequence_lengths=lengths,
        )


@functools.cache
def tool_arithmetic_config():
    """``core/configs/grpo_tool_arithmetic.yaml`` with this workload's group and batch sizes
    (a ``GRPORunConfig``; loaded once: reading the YAML files is not free)."""
    from core.algorithms.config import GRPORunConfig
    from core.config import load_config
    from core.config.loader import DEFAULT_CONFIG_PATH

    rows = len(SCRIPTS) * GROUP
    overrides = [
        f"grpo.num_prompts_per_step={len(SCRIPTS)}",
        f"grpo.num_generations_per_prompt={GROUP}",
        f"grpo.max_rollout_turns={MAX_TURNS}",
        f"policy.train_global_batch_size={rows}",
        f"policy.train_micro_batch_size={rows // 2}",  # the config's 2 GPUs as 2 data-parallel ranks
    ]
    return load_config(DEFAULT_CONFIG_PATH.with_name("grpo_tool_arithmetic.yaml"), overrides, schema=GRPORunConfig)


@dataclass
class MultiTurnWorkload:
    """The episodes' fixed parts: tokenizer, prompts, environment, GRPO config, sequence limit."""

    tokenizer: Any
    max_total_tokens: int
    cfg: Any  # GRPORunConfig of core/configs/grpo_tool_arithmetic.yaml

    @classmethod
    def build(cls, vocab_size: int, max_total_tokens: int) -> MultiTurnWorkload:
        tokenizer = workload_tokenizer()
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"grpo_multi_turn_step0: the episodes' tokenizer has {len(tokenizer)} ids, "
                f"the model's vocabulary {vocab_size}"
            )
        workload = cls(tokenizer, max_total_tokens, tool_arithmetic_config())
        # Refused before anything starts: a --seq the conversations do not fit (a dry run, no model).
        unbounded = cls(tokenizer, 1 << 30, workload.cfg)
        width = int(
            unbounded.batch(lambda ids, lengths: ids.new_zeros(ids.shape, dtype=float))[0]["input_lengths"].max()
        )
        if width > max_total_tokens:
            raise ValueError(
                f"grpo_multi_turn_step0: the scripted conversations are {width} tokens long, "
                f"--seq is {max_total_tokens}"
            )
        return workload

    def prompts(self) -> list[list[int]]:
        bos = self.tokenizer.bos_token_id
        return [[bos, *self.tokenizer.encode(f"{p} =", add_special_tokens=False)] for p, _, eps in SCRIPTS for _ in eps]

    def batch(self, logprobs: LogprobsFn):
        """The GRPO train batch of the scripted episodes (see the module docstring), and the
        per-row data compared exactly (plain lists)."""
        import torch

        from core.algorithms.grpo import training_data
        from core.algorithms.multi_turn import EpisodeRunner, episodes_to_rows
        from core.algorithms.observation_tokens import ObservationTokens
        from core.environments.registry import make_multi_turn_environment

        tok, cfg = self.tokenizer, self.cfg
        stops = [tok.eos_token_id]
        runner = EpisodeRunner(
            make_multi_turn_environment(cfg.env),
            tok,
            ObservationTokens(tok, use_chat_template=False, stop_token_ids=stops),
            max_turns=cfg.grpo.max_rollout_turns,
            max_total_tokens=self.max_total_tokens,
            step_timeout_s=cfg.env.timeout_s,
        )
        prompts = self.prompts()
        turns = [turns for _, _, eps in SCRIPTS for turns in eps]
        metadata = [{"ground_truth": truth} for _, truth, eps in SCRIPTS for _ in eps]
        engine = ScriptedEngine(tok, turns, prompts, logprobs, self.max_total_tokens)
        episodes = runner.run(prompts, metadata, engine, greedy=True, seed=cfg.grpo.seed, step=0)
        unfinished = [ep.row for ep in episodes if ep.ended != "done"]
        if unfinished:  # a script cut by --seq would train on a different conversation
            raise ValueError(
                f"grpo_multi_turn_step0: episodes {unfinished} did not end within {self.max_total_tokens} tokens "
                "(--seq) and the scripted turns"
            )
        rows = episodes_to_rows(episodes, tok.pad_token_id)
        data, _ = training_data(cfg.grpo, rows, torch.ones(rows.size), stops, cfg.policy.generation.max_new_tokens)
        exact = {k: data[k].tolist() for k in EXACT_KEYS if k in data}
        exact.update(rewards=rows["rewards"].tolist(), turns=rows["turns"].tolist())
        return data, exact


def multi_turn_step(workload: MultiTurnWorkload, logprobs: LogprobsFn, train: Callable[[Any], dict]) -> dict:
    """Episodes (their generation logprobs from ``logprobs``), one GRPO ``train(data) ->
    grpo_summary`` and the updated logprobs: the measurement ``grpo_multi_turn_step0`` compares."""
    data, exact = workload.batch(logprobs)
    summary = train(data)
    return {
        "grpo_multi_turn": summary,
        "multi_turn_episodes": exact,
        "multi_turn_generation_logprobs": data["generation_logprobs"],
        "multi_turn_logprobs": logprobs(data["input_ids"], data["input_lengths"]),
    }


def multi_turn_policy(runner, workload: MultiTurnWorkload, steps: int) -> dict:
    """:func:`multi_turn_step` on a layout: ``grpo_step0_policy`` (old and reference log-probs
    from the policy, one ``train`` call of ``steps`` optimizer steps)."""
    from core.data import BatchedDataDict

    policy = runner.policy

    def logprobs(ids, lengths):
        policy.prepare_for_lp_inference()
        data = BatchedDataDict(input_ids=ids.contiguous(), input_lengths=lengths.contiguous())
        return policy.get_logprobs(data)["logprobs"]

    return multi_turn_step(workload, logprobs, lambda data: grpo_step0_policy(runner, data, steps))


def multi_turn_hf(hf, workload: MultiTurnWorkload, steps: int) -> dict:
    """:func:`multi_turn_step` on the HF reference (reference log-probs: its initial model)."""

    def train(data) -> dict:
        data = dict(data)
        data["prev_logprobs"] = hf.logprobs(data["input_ids"], data["input_lengths"])
        data["reference_policy_logprobs"] = hf.reference_logprobs(data["input_ids"], data["input_lengths"])
        return hf.grpo_steps(data, grpo_loss_fn(), steps)

    return multi_turn_step(workload, hf.logprobs, train)
