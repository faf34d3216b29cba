"""`mars-hf reduce-rank` (mars_hf/models/rank_reduction.py) against a slow SVD of each full update."""

from __future__ import annotations

import json

import pytest
import torch

from mars_hf import cli
from mars_hf.decoding import gated_lora
from mars_hf.decoding.generation import enable_mars
from mars_hf.models.rank_reduction import reduce_adapter_rank, reduce_pair
from tests.test_gated_lora import shipped_gated


def best_rank_k(update: torch.Tensor, rank: int) -> tuple[torch.Tensor, float]:
    """Eckart–Young, the slow way: the full SVD of the ``out x in`` update, truncated."""
    u, s, vh = torch.linalg.svd(update.double(), full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank], float((s[:rank] ** 2).sum() / (s**2).sum())


@pytest.mark.parametrize("rank", [1, 3, 5])
def test_a_reduced_pair_is_the_best_rank_k_approximation_of_the_scaled_update(rank):
    torch.manual_seed(0)
    A, B, scaling = torch.randn(6, 20, dtype=torch.float64), torch.randn(12, 6, dtype=torch.float64), 2.5
    new_a, new_b, energy = reduce_pair(A, B, scaling, rank)
    expected, expected_energy = best_rank_k(scaling * B @ A, rank)
    assert new_a.shape == (rank, 20) and new_b.shape == (12, rank)
    torch.testing.assert_close(new_b @ new_a, expected, rtol=1e-10, atol=1e-10)
    assert energy == pytest.approx(expected_energy, rel=1e-10)


def adapter_updates(folder) -> dict[str, torch.Tensor]:
    """Each adapted layer's ``scaling · B A`` as mars_hf's own loader reads the folder."""
    pairs, scaling = gated_lora.read_adapter_weights(folder)
    return {path: scaling * pair["B"].double() @ pair["A"].double() for path, pair in pairs.items()}


def test_a_reduced_gated_checkpoint_holds_the_truncated_updates_and_still_decodes_like_the_base(
    tokenizer, tmp_path
):
    """The rank-4 tiny adapter at rank 2: both PEFT and mars_hf's loader read the truncated updates; the gate
    and mask rows are kept, so verified decoding is still the base model's greedy output (float64)."""
    from peft import PeftModel

    from mars_hf.models.gated_peft import MaskGatedLoraConfig

    base, _, _, folder = shipped_gated(tmp_path, "llama", tokenizer)
    out = tmp_path / "reduced"
    report = reduce_adapter_rank(folder, out, 2)
    assert (report.old_rank, report.new_rank) == (4, 2) and 0 < report.min_kept_energy < 1
    original, reduced = adapter_updates(folder), adapter_updates(out)
    assert set(reduced) == set(original)
    for path, update in original.items():
        truncated, energy = best_rank_k(update, 2)
        torch.testing.assert_close(reduced[path], truncated, rtol=1e-5, atol=1e-6)
        assert report.kept_energy[f"base_model.model.{path}"] == pytest.approx(energy, rel=1e-6)
    # PEFT reads the new config (r, lora_alpha) into the same update (plain PEFT refuses a gated adapter's
    # peft_type: the config comes from mars_hf)
    config = MaskGatedLoraConfig.from_pretrained(out)
    assert config.r == 2
    peft_model = PeftModel.from_pretrained(base, str(out), config=config)
    for path, update in reduced.items():
        layer = peft_model.get_submodule(f"base_model.model.{path}")
        torch.testing.assert_close(layer.get_delta_weight("default").double(), update, rtol=1e-5, atol=1e-6)
    for name in ("mars_config.json", gated_lora.MARS_MASK_ROWS_FILE):
        assert (out / name).read_bytes() == (folder / name).read_bytes()

    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base-llama", dtype=torch.float64)
    assert gated_lora.attach_shipped_adapter(plain, out)
    plain = enable_mars(plain)
    inputs = tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "base-llama", dtype=torch.float64)
    common = dict(max_new_tokens=10, do_sample=False)
    expected = stock.generate(**inputs, suppress_tokens=[tokenizer.mask_token_id], **common)
    assert torch.equal(plain.generate(**inputs, mars_acceptance="verify", **common), expected)


def test_it_refuses_a_rank_that_reduces_nothing_and_writing_over_the_original(tokenizer, tmp_path):
    _, _, _, folder = shipped_gated(tmp_path, "llama", tokenizer)
    for rank in (0, 4, 8):
        with pytest.raises(ValueError, match="between 1 and the adapter's rank minus one"):
            reduce_adapter_rank(folder, tmp_path / "out", rank)
    with pytest.raises(ValueError, match="new folder"):
        reduce_adapter_rank(folder, folder, 2)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4  # untouched


def test_the_command_writes_the_folder_and_says_what_was_kept(tokenizer, tmp_path, capsys):
    _, _, _, folder = shipped_gated(tmp_path, "llama", tokenizer)
    assert cli.main(["reduce-rank", str(folder), "--rank", "3", "--out", str(tmp_path / "r3")]) == 0
    assert "rank 4 -> 3" in capsys.readouterr().out
    config = json.loads((tmp_path / "r3" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (3, 3, False)
