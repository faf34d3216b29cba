import os
import socket

import pytest
import torch

from tests.bare_venv import make_bare_venv
from tests.tiny import ARCHITECTURES, tiny_model, tiny_tokenizer

# Two cores are shared by the whole suite; more threads only add contention on tiny models.
torch.set_num_threads(1)
# No cost curve from an earlier run (or another machine's load) on disk: every test measures its own, and
# `mars-hf generate` / `serve` run by tests (their default is $MARS_HF_HOME/cost-curves) write none.
os.environ.setdefault("MARS_HF_COST_CACHE", "")


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(params=ARCHITECTURES)
def arch(request):
    return request.param


@pytest.fixture
def model(arch):
    return tiny_model(arch)


@pytest.fixture(scope="session")
def bare_venv(tmp_path_factory):
    """A virtual environment with only torch and transformers (no mars_hf, peft or trl); its python."""
    return make_bare_venv(tmp_path_factory.mktemp("bare_venv"))


@pytest.fixture
def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it): servers and process groups a test starts then meet
    no other run's (torchrun's default 29500 is shared by every launch on the machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
