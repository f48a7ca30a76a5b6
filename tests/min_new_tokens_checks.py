"""``policy.generation.min_new_tokens``: the checks every generation engine's test applies (HF
``generate`` in tests/unit/test_hf_generation.py, JAX ``generate`` in
tests/jax_backend/test_generate.py, vLLM in tests/generation/test_refit_llama.py).

To make the minimum bite on a random tiny model (which almost never samples its eos), all of
the vocabulary but a few ids are stop tokens: without a minimum every row ends at once."""

from __future__ import annotations

import numpy as np

#: The ids that are *not* stop tokens in these checks (the rest of the 256-token vocabulary is).
KEEP = tuple(range(3, 256, 16))


def stop_heavy_ids(vocab: int = 256) -> list[int]:
    """Every id of the vocabulary except :data:`KEEP`."""
    return [t for t in range(vocab) if t not in KEEP]


def rows_of(out, input_lengths) -> list[list[int]]:
    """Each row's generated tokens (up to its generation length) from a ``GenerationOutputSpec``."""
    ids, lengths = np.asarray(out["output_ids"]), np.asarray(out["generation_lengths"])
    starts = np.asarray(input_lengths)
    return [ids[b, starts[b] : starts[b] + lengths[b]].tolist() for b in range(len(starts))]


def assert_min_length(out, input_lengths, min_new: int, max_new: int, stop_ids) -> None:
    """Every row has at least ``min_new`` tokens (all of them when ``min_new == max_new``), none
    of its first ``min_new`` tokens is a stop token, and a row shorter than ``max_new`` ends
    with one."""
    lengths = np.asarray(out["generation_lengths"]).tolist()
    stop = set(stop_ids)
    for b, row in enumerate(rows_of(out, input_lengths)):
        assert min(min_new + 1, max_new) <= lengths[b] <= max_new, (b, lengths[b], min_new)
        assert not stop & set(row[:min_new]), (b, row)
        if lengths[b] < max_new:
            assert row[-1] in stop, (b, row)


def assert_stops_at_once(out) -> None:
    """Without a minimum the stop-heavy vocabulary ends rows early (else the checks above are vacuous)."""
    lengths = np.asarray(out["generation_lengths"])
    assert (lengths < 3).sum() >= len(lengths) // 2, lengths.tolist()
