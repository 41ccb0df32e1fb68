import functools

import pytest
from support.tiny import cached_tiny_model_dir

from dynaspec.models import packs


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Build (once per session) a tiny random-weight HF model directory: tiny_dir(arch=..., seed=...)."""
    return functools.partial(cached_tiny_model_dir, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def target_dir(tiny_dir):
    return tiny_dir(arch="qwen2", seed=0, num_layers=2)


@pytest.fixture(scope="session")
def draft_dir(tiny_dir):
    """A different, smaller model sharing the target's tokenizer: partial acceptance."""
    return tiny_dir(arch="qwen2", seed=1, num_layers=1)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty dynaspec cache of the test's own: nothing the test does may touch the real one."""
    monkeypatch.setenv(packs.CACHE_ENV, str(tmp_path / "cache"))
