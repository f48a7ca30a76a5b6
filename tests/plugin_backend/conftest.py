import pytest

from tests.plugin_backend.site import installed


@pytest.fixture(scope="package", autouse=True)
def plugin_backend_visible():
    """The plug-in registered (by its entry point) in this process while its tests run."""
    with installed():
        yield
