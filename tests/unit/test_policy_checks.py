"""``core.policy.checks`` on the batches that reach it: the vLLM engine actors get theirs from
Ray's object store, which hands numpy arrays out read-only."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from core.policy.checks import BatchError, check_model_inputs


def read_only(values, dtype) -> np.ndarray:
    array = np.array(values, dtype=dtype)
    array.setflags(write=False)  # what ray.get returns for a numpy array
    return array


def engine_input(ids) -> dict[str, np.ndarray]:
    return {
        "input_ids": read_only(ids, np.int64),
        "input_lengths": read_only([3, 2], np.int64),
        "token_mask": read_only([[0, 1, 1], [0, 1, 0]], np.float32),
        "sample_mask": read_only([1, 1], np.float32),
    }


def test_read_only_numpy_batches_are_checked_without_a_torch_warning(monkeypatch):
    """torch warns (once per process) when it wraps a read-only buffer; the check must copy such
    an array instead.  The spy sees every array handed to torch, so this holds even when another
    test already used up torch's one warning."""
    handed: list = []
    as_tensor = torch.as_tensor

    def spy(x, *args, **kwargs):
        handed.append(x)
        return as_tensor(x, *args, **kwargs)

    monkeypatch.setattr(torch, "as_tensor", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the UserWarning "The given NumPy array is not writable" fails here
        check_model_inputs(engine_input([[1, 2, 3], [4, 5, 0]]), vocab_size=6, what="engine input")
    arrays = [x for x in handed if isinstance(x, np.ndarray)]
    assert len(arrays) >= 4, handed  # ids, lengths and both masks were checked
    assert all(a.flags.writeable for a in arrays)


def test_a_read_only_batch_is_still_checked():
    with pytest.raises(BatchError, match=r"engine input\['input_ids'\]\[1, 2\] = 9 is outside the vocabulary"):
        check_model_inputs(engine_input([[1, 2, 3], [4, 5, 9]]), vocab_size=6, what="engine input")
