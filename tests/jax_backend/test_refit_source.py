"""The JAX worker's side of a refit: metadata without a gather, tensors laid out and cast on the devices.

``prepare_refit_info`` answers from the HF mapping's shapes (it works with the params
offloaded to host memory and leaves them there; on CPU devices the offload moves nothing);
``iter_full_weights(dtype)`` lays out and casts each tensor on the devices -- one program per
distinct shape, shared by the layers -- and its tensors equal, bit for bit, the host-side
conversion of the gathered params.
"""

from __future__ import annotations

import jax
import ml_dtypes
import pytest
import torch

from backends.jax_pjit.hf_mapping import jax_to_hf_tensors
from backends.jax_pjit.sharding import host_copy
from core.refit.manifest import dtype_name
from core.refit.packing import as_torch

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")


@pytest.fixture
def worker(qwen2_worker):
    return qwen2_worker


@pytest.mark.parametrize("dtype", ["bfloat16", None])
def test_stream_equals_the_host_conversion(worker, dtype):
    reference = jax_to_hf_tensors(host_copy(worker.params), worker.model_cfg)
    programs_before = worker._hf_layout._cache_size()  # the module's worker may have streamed already
    streamed = list(worker.iter_full_weights(dtype))
    assert [name for name, _ in streamed] == list(reference)
    for name, array in streamed:
        expected = reference[name] if dtype is None else reference[name].astype(ml_dtypes.bfloat16)
        # The stream carries numpy arrays or torch views of XLA's buffers (a replicated array).
        tensor, wanted = as_torch(array), as_torch(expected)
        assert dtype_name(tensor.dtype) == dtype_name(expected.dtype), name
        assert tensor.shape == wanted.shape and _bits(tensor) == _bits(wanted), name
    # One program per distinct (shape, transform, dtype): the 2 layers share theirs.
    assert worker._hf_layout._cache_size() - programs_before < len(streamed)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_prepare_refit_info_is_metadata_only(worker, monkeypatch):
    streamed = {name: (tuple(a.shape), dtype_name(a.dtype)) for name, a in worker.iter_full_weights()}
    # The offload of a worker on accelerators (CPU devices keep their buffers: the test below).
    monkeypatch.setattr(type(worker), "_offload_frees_device_memory", property(lambda self: True))
    worker.offload_after_refit()  # params to host memory: nothing on the devices to gather
    try:
        info = worker.prepare_refit_info()
        assert worker.params is None  # not brought back
        assert list(info) == list(streamed) and info == streamed
    finally:
        worker.prepare_for_training()


def test_offload_on_cpu_devices_moves_nothing(worker):
    """CPU devices' buffers are host memory: the placement calls keep the very same arrays (no
    copy out before a refit and back before the next call)."""
    params, opt_state = worker.params, worker.opt_state
    assert opt_state is not None
    worker.offload_before_refit()
    worker.offload_after_refit()
    assert worker.params is params and worker.opt_state is opt_state and not worker._host_copies
    worker.prepare_for_training()
    assert worker.params is params and worker.opt_state is opt_state
