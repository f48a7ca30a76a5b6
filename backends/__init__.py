"""Training backends.  Each sub-package holds only what is specific to its engine:

* ``backends.torch_fsdp``    PyTorch FSDP1 (``FSDP1PolicyWorker``)
* ``backends.torch_dtensor`` PyTorch FSDP2 + tensor/sequence/context parallel (``DTensorPolicyWorker``)
* ``backends.jax_pjit``      JAX ``jit`` over a named (fsdp, tp) mesh (``JaxPolicyWorker``)

Everything the backends share (protocol, data, config, kernels, losses) lives in ``core``.
"""
