"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2; NeMo RL's ``grpo.use_dynamic_sampling``).

A group whose samples all got the same reward has advantage 0 under a group baseline: it
spends a share of the batch on no gradient.  With dynamic sampling a step keeps generating
from further prompts -- ``num_prompts_per_step`` prompts per generate call, at most
``dynamic_sampling_max_gen_batches`` calls -- until it holds ``num_prompts_per_step``
*informative* groups (rewards not all equal), and trains on the first of them in generation
order; the surplus of the last call is dropped.  Informative means the environment's
rewards, before ``grpo.reward_shaping`` (DAPO filters on accuracy; NeMo RL on the unshaped
reward): a length penalty alone does not make a group worth training on.

The extra calls are seeded like the first: call ``c`` of step ``s`` samples with
``sample_seeds(seed, s, rows, stream=c)``, so a run is repeatable and call 0 draws exactly
the rollouts of a run without dynamic sampling.

At the cap with too few informative groups (``dynamic_sampling_on_shortfall``): ``train``
trains on them, the batch filled up to the next multiple of ``policy.train_global_batch_size``
with rows of dropped groups whose ``sample_mask`` is 0 -- whole global batches, each holding at
least one informative row, so fewer rows make fewer optimizer steps rather than a step on
nothing, and each step's loss, normalised by its *valid* sequences and tokens, is that of its
informative rows alone -- ``skip`` trains on nothing this step, ``error`` stops the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch


class DynamicSamplingError(RuntimeError):
    """The cap was reached with too few informative groups and the config says error."""


class _Scored(Protocol):
    @property
    def rewards(self) -> torch.Tensor: ...


B = TypeVar("B", bound=_Scored)


@dataclass(frozen=True)
class GroupSelection:
    """Which generated groups a step trains on, out of every generate call's groups in order."""

    rows: torch.Tensor  # long: rows of the concatenated calls, whole groups, informative ones first
    trained: torch.Tensor  # float per row: 1 on informative groups' rows, 0 on filler rows
    train_rows: int  # the leading rows the step trains on: a multiple of the global batch size
    informative: int  # informative groups trained on (<= target)
    dropped: int  # groups generated with all-equal rewards
    surplus: int  # informative groups generated beyond the target (not trained on)
    gen_batches: int  # generate calls made
    cap_hit: bool  # the calls stopped at the cap with fewer than target informative groups

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/gen_batches": float(self.gen_batches),
            "dynamic_sampling/informative_groups": float(self.informative),
            "dynamic_sampling/dropped_groups": float(self.dropped),
            "dynamic_sampling/surplus_groups": float(self.surplus),
            "dynamic_sampling/cap_hit": float(self.cap_hit),
        }


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups of ``rewards`` [B] whose rewards are not all equal."""
    groups = torch.as_tensor(rewards).reshape(-1, group_size)
    return groups.max(1).values != groups.min(1).values


def sample_until_informative(
    sample: Callable[[int], B], group_size: int, target_groups: int, max_batches: int, batch_multiple: int
) -> tuple[list[B], GroupSelection]:
    """``sample(call)`` for calls 0, 1, ... until ``target_groups`` informative groups exist or
    ``max_batches`` calls were made; the calls' results and the rows to train on (see
    :func:`select_groups`)."""
    batches: list[B] = []
    flags: list[torch.Tensor] = []
    for call in range(max_batches):
        batches.append(sample(call))
        flags.append(informative_groups(batches[-1].rewards, group_size))
        if int(torch.cat(flags).sum()) >= target_groups:
            break
    return batches, select_groups(torch.cat(flags), group_size, target_groups, len(batches), batch_multiple)


def select_groups(
    flags: torch.Tensor, group_size: int, target_groups: int, gen_batches: int, batch_multiple: int
) -> GroupSelection:
    """The first ``target_groups`` informative groups of ``flags`` [num_groups] in order; when
    there are fewer, the first non-informative groups follow as masked filler, enough that the
    trained rows reach the next multiple of ``batch_multiple`` (the global batch size; one
    global batch when there is no informative group at all, a step that is then skipped).
    ``target_groups x group_size`` must be a multiple of ``batch_multiple`` (the config's rule)."""
    informative = torch.nonzero(flags).reshape(-1)
    kept = informative[:target_groups]
    wanted = len(kept) * group_size
    train_rows = max(-(-wanted // batch_multiple), 1) * batch_multiple
    filler = torch.nonzero(~flags).reshape(-1)[: -(-(train_rows - wanted) // group_size)]
    if wanted + len(filler) * group_size < train_rows:
        raise ValueError(f"{len(flags)} groups of {group_size} cannot fill {train_rows} rows")
    groups = torch.cat([kept, filler])
    rows = (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    trained = torch.cat([torch.ones(wanted), torch.zeros(len(filler) * group_size)])
    return GroupSelection(
        rows=rows,
        trained=trained,
        train_rows=train_rows,
        informative=len(kept),
        dropped=int((~flags).sum()),
        surplus=len(informative) - len(kept),
        gen_batches=gen_batches,
        cap_hit=len(kept) < target_groups,
    )
