"""The generation tests' fixture of tiny vLLM-ready models, shared with the fault tests."""

from tests.generation.conftest import gen_model_dirs  # noqa: F401 (fixture)
