"""``MARSConfig.init_adapter``: training starts exactly where a saved MARS adapter ended."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from mars_hf.decoding import gated_lora
from mars_hf.training.config import MARSConfig
from mars_hf.training.trainer import MARSTrainer
from tests.test_gated_lora import chat_dataset, make_trainer, trained_gated  # noqa: F401  (a fixture)
from tests.tiny import tiny_tokenizer


def warm_trainer(
    tmp_path, base_dir, checkpoint, r=8, alpha=24, target_modules="all-linear", extra_token=None, **config
):
    """A MARSTrainer on a fresh copy of the base (its tokenizer without the mask token; ``extra_token`` added
    first moves the mask token's id) started from ``checkpoint``."""
    tokenizer = tiny_tokenizer(with_mask=False)
    if extra_token is not None:
        tokenizer.add_tokens([extra_token])
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    # init_lora_weights=False: PEFT starts B random, so the ranks beyond the checkpoint's must be zeroed by us
    peft_config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, init_lora_weights=False
    )
    settings = {"max_steps": 1, "learning_rate": 5e-2, "ar_weight": 0.0, "adapter_gating": "mask", **config}
    trainer = make_trainer(
        tmp_path, tokenizer, model, "gated", peft_config=peft_config, init_adapter=str(checkpoint), **settings
    )
    return trainer, tokenizer


def mask_logits(model, tokenizer):
    mask = tokenizer.mask_token_id
    ids = torch.tensor([[5, 6, 7, mask, mask], [8, 9, mask, 10, mask]])
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_training_starts_from_the_saved_adapter_exactly(trained_gated, tmp_path):  # noqa: F811
    """Before the first step the new (larger-rank, differently scaled) adapter computes what the checkpoint
    computes, mask rows and all; then training moves it."""
    _, _, base_dir, checkpoint, _ = trained_gated
    trainer, tokenizer = warm_trainer(tmp_path, base_dir, checkpoint)
    shipped = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    assert gated_lora.attach_shipped_adapter(shipped, checkpoint)
    expected = mask_logits(shipped, tokenizer)
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    plain.resize_token_embeddings(shipped.get_input_embeddings().weight.shape[0])
    assert not torch.allclose(mask_logits(plain, tokenizer), expected)  # the checkpoint really adapts masks
    torch.testing.assert_close(mask_logits(trainer.model, tokenizer), expected, rtol=1e-10, atol=1e-10)

    lora_b = next(m.lora_B["default"].weight for m in trainer.model.modules() if hasattr(m, "lora_B"))
    assert lora_b.shape[1] == 8 and torch.count_nonzero(lora_b[:, 4:]) == 0  # extra ranks add nothing yet
    trainer.model.train()
    trainer.train()
    assert not torch.allclose(mask_logits(trainer.model, tokenizer), expected)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(r=2), r"rank 4 .* Use lora_r >= 4"),
        (dict(target_modules=["q_proj"]), r"adapts \d+ layer\(s\) this run's LoRA does not"),
        (dict(adapter_gating=None), r"trained with adapter_gating='mask', this run uses None"),
        (dict(extra_token="<|other|>"), r"mask token at id \d+, this run's tokenizer at \d+"),
    ],
)
def test_a_start_that_would_not_be_the_saved_model_is_refused(trained_gated, tmp_path, change, message):  # noqa: F811
    _, _, base_dir, checkpoint, _ = trained_gated
    with pytest.raises(ValueError, match=message):
        warm_trainer(tmp_path, base_dir, checkpoint, **change)


def test_init_adapter_needs_a_lora_config(trained_gated, tmp_path):  # noqa: F811
    _, _, base_dir, checkpoint, _ = trained_gated
    tokenizer = tiny_tokenizer(with_mask=False)
    args = MARSConfig(
        output_dir=str(tmp_path / "warm"), report_to="none", use_cpu=True, bf16=False, block_size=2,
        init_adapter=str(checkpoint),
    )
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    with pytest.raises(ValueError, match="init_adapter starts a new LoRA adapter from a saved one"):
        MARSTrainer(model=model, args=args, train_dataset=chat_dataset(tokenizer), processing_class=tokenizer)
