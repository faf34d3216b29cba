import pytest
import torch

from tests.bare_venv import make_bare_venv
from tests.tiny import ARCHITECTURES, tiny_model, tiny_tokenizer

# Two cores are shared by the whole suite; more threads only add contention on tiny models.
torch.set_num_threads(1)


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
