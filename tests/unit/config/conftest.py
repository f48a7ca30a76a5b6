"""The default config, loaded once per module and copied per test."""

from __future__ import annotations

import copy

import pytest

from core.config import DEFAULT_CONFIG_PATH, load_yaml


@pytest.fixture(scope="module")
def default_raw():
    return load_yaml(DEFAULT_CONFIG_PATH)


@pytest.fixture
def cfg(default_raw):
    return copy.deepcopy(default_raw)
