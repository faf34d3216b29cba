"""`MARSTrainer.compute_loss` against a slow definitional computation of docs/method.md §1.3-1.4, and the
trainer's integration with TRL/PEFT (formats, accumulation, checkpointing, LoRA, saving, errors)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset, Features, IterableDataset, Value
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_hf import MARSConfig, MARSDataCollator, MARSTrainer
from mars_hf.training.attention_mask import build_mars_inputs, mars_attention_mask
from tests.tiny import tiny_model, tiny_tokenizer

ASSISTANT = [
    "one two three four five six seven",
    "red blue green",
    "yes no yes no yes",
    "the dog sat on the mat",
]
USER = ["the cat sat on the mat", "is the dog red", "hello world", "print x y z and one two"]


def chat_dataset(n=8):
    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": USER[i % 4]},
                    {"role": "assistant", "content": ASSISTANT[i % 4]},
                ]
            }
            for i in range(n)
        ]
    )


def prompt_completion_dataset(n=8):
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": USER[i % 4]}],
                "completion": [{"role": "assistant", "content": ASSISTANT[i % 4]}],
            }
            for i in range(n)
        ]
    )


def config(tmp_path, **overrides):
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=4,
        max_steps=1,
        dataloader_num_workers=0,
    )
    defaults.update(overrides)
    return MARSConfig(**defaults)


def make_trainer(tmp_path, model=None, tokenizer=None, dataset=None, **overrides):
    tokenizer = tokenizer or tiny_tokenizer()
    model = model if model is not None else tiny_model("llama", tokenizer=tokenizer)
    peft_config = overrides.pop("peft_config", None)
    eval_dataset = overrides.pop("eval_dataset", None)
    return MARSTrainer(
        model=model,
        args=config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else chat_dataset(),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def right_padded_batch(seed=0, lengths=(13, 9, 6), prompts=(5, 3, 2), vocab=40):
    """input_ids / attention_mask / labels like TRL's collator: right-padded with pad == EOS (2)."""
    generator = torch.Generator().manual_seed(seed)
    total = max(lengths)
    input_ids = torch.randint(3, vocab, (len(lengths), total), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (length, prompt) in enumerate(zip(lengths, prompts)):
        input_ids[row, length - 1] = 2  # ends with EOS, like a real example
        input_ids[row, length:] = 2
        attention_mask[row, :length] = 1
        labels[row, prompt:length] = input_ids[row, prompt:length]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@torch.no_grad()
def definitional_losses(model, batch, block_size, mask_token_id):
    """Per target, run the model causally on exactly the context §1.3 gives that prediction."""
    clean, noisy = [], []
    for row in range(batch["input_ids"].shape[0]):
        real = int(batch["attention_mask"][row].sum())
        x = batch["input_ids"][row, :real].tolist()
        y = batch["labels"][row, :real].tolist()
        noisy_tokens = [mask_token_id if y[q] != -100 else x[q] for q in range(real)]
        for t in range(1, real):
            if y[t] == -100:
                continue
            target = torch.tensor([y[t]])
            logit = model(input_ids=torch.tensor([x[:t]])).logits[0, -1:]
            clean.append(F.cross_entropy(logit, target).item())
            k = (t - 1) // block_size  # the noisy slot p = t - 1 lives in block k
            context = x[: k * block_size] + noisy_tokens[k * block_size : t]
            logit = model(input_ids=torch.tensor([context])).logits[0, -1:]
            noisy.append(F.cross_entropy(logit, target).item())
    return torch.tensor(clean, dtype=torch.float64), torch.tensor(noisy, dtype=torch.float64)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_loss_matches_definition(tmp_path, arch, block_size):
    model = tiny_model(arch)
    trainer = make_trainer(tmp_path, model=model)
    mask_token_id = model.config.mars["mask_token_id"]
    batch = right_padded_batch(seed=block_size)
    clean, noisy = definitional_losses(model, batch, block_size, mask_token_id)
    n = len(clean)

    # Per target: the fast two-stream forward gives the same CE for every target, in both halves.
    inputs = build_mars_inputs(
        batch["input_ids"],
        batch["attention_mask"],
        batch["labels"],
        block_size=block_size,
        mask_token_id=mask_token_id,
    )
    with torch.no_grad():
        logits = model(
            input_ids=inputs.input_ids,
            attention_mask=mars_attention_mask(inputs, "sdpa"),
            position_ids=inputs.position_ids,
        ).logits
    ce = F.cross_entropy(
        logits.flatten(0, 1), inputs.shift_labels.flatten(), reduction="none", ignore_index=-100
    )
    ce = ce.view_as(inputs.shift_labels)
    length = batch["input_ids"].shape[1]
    fast_clean = ce[:, :length][inputs.shift_labels[:, :length] != -100]
    # Targets in the same (row, position) order as the slow loop.
    fast_noisy = []
    for row in range(ce.shape[0]):
        slots = [(inputs.position_ids[row, j].item(), j) for j in range(length, ce.shape[1])]
        fast_noisy += [ce[row, j] for _, j in sorted(slots) if inputs.shift_labels[row, j] != -100]
    torch.testing.assert_close(fast_clean, clean, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.stack(fast_noisy), noisy, rtol=0, atol=1e-6)

    for ar_weight in (1.0, 0.3, 0.0):
        for drop in (True, False):
            trainer.args.block_size, trainer.args.ar_weight = block_size, ar_weight
            trainer.args.drop_target_free_blocks = drop
            with torch.no_grad():
                loss = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
            expected = (noisy.sum() + ar_weight * clean.sum()) / n
            assert abs(loss.item() - expected.item()) < 1e-6, (ar_weight, drop)


def _loss_and_grads(trainer, model, batch, **kwargs):
    model.zero_grad()
    loss = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()}, **kwargs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_dropped_blocks_give_identical_loss_and_gradients(tmp_path, arch):
    model = tiny_model(arch)
    model.train()
    trainer = make_trainer(tmp_path, model=model)
    batch = right_padded_batch(seed=3, lengths=(30, 22, 17), prompts=(21, 14, 12))
    trainer.args.drop_target_free_blocks = False
    full_loss, full_grads = _loss_and_grads(trainer, model, batch)
    trainer.args.drop_target_free_blocks = True
    drop_loss, drop_grads = _loss_and_grads(trainer, model, batch)
    assert abs(full_loss.item() - drop_loss.item()) < 1e-12
    assert full_grads.keys() == drop_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(drop_grads[name], full_grads[name], rtol=0, atol=1e-12)


def test_num_items_in_batch_makes_accumulation_exact(tmp_path):
    model = tiny_model("qwen2")
    trainer = make_trainer(tmp_path, model=model)
    whole = right_padded_batch(seed=5, lengths=(13, 9, 11, 6), prompts=(5, 3, 8, 2))
    halves = [{k: v[rows] for k, v in whole.items()} for rows in (slice(0, 2), slice(2, 4))]
    n_total = sum(int((half["labels"][:, 1:] != -100).sum()) for half in halves)
    whole_loss, whole_grads = _loss_and_grads(trainer, model, whole)
    accumulated_loss, accumulated = 0.0, None
    for half in halves:
        loss, grads = _loss_and_grads(trainer, model, half, num_items_in_batch=torch.tensor(n_total))
        accumulated_loss += loss.item()
        accumulated = grads if accumulated is None else {k: accumulated[k] + grads[k] for k in grads}
    assert abs(accumulated_loss - whole_loss.item()) < 1e-12
    for name in whole_grads:
        torch.testing.assert_close(accumulated[name], whole_grads[name], rtol=0, atol=1e-12)


def test_gradient_accumulation_in_training_matches_one_big_batch(tmp_path):
    """Through `Trainer`: batch 4 in one step == batch 2 with 2 accumulation steps (same data)."""
    tokenizer = tiny_tokenizer()
    dataset = chat_dataset(4)
    params = []
    for batch_size, steps in ((4, 1), (2, 2)):
        model = tiny_model("llama", tokenizer=tokenizer)
        trainer = make_trainer(
            tmp_path,
            model=model,
            tokenizer=tokenizer,
            dataset=dataset,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=steps,
            optim="sgd",
            learning_rate=0.5,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
        )
        trainer.train()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name in params[0]:
        torch.testing.assert_close(params[1][name], params[0][name], rtol=0, atol=1e-10)


def test_batch_without_targets_gives_zero_loss_with_graph(tmp_path):
    model = tiny_model("llama")
    trainer = make_trainer(tmp_path, model=model)
    batch = right_padded_batch()
    batch["labels"][:] = -100
    loss = trainer.compute_loss(model, batch)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()  # does not raise


def test_gradient_checkpointing_gives_same_loss_and_gradients(tmp_path):
    model = tiny_model("mistral")
    model.train()
    trainer = make_trainer(tmp_path, model=model)
    batch = right_padded_batch(seed=7)
    model.gradient_checkpointing_disable()
    plain = _loss_and_grads(trainer, model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _loss_and_grads(trainer, model, batch)
    assert abs(plain[0].item() - checkpointed[0].item()) < 1e-12
    for name in plain[1]:
        torch.testing.assert_close(checkpointed[1][name], plain[1][name], rtol=0, atol=1e-12)


def _fixed_batch_loss(trainer, model):
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        return trainer.compute_loss(model, batch).item(), batch


def test_full_training_lowers_loss_and_checkpoint_reloads(tmp_path):
    tokenizer = tiny_tokenizer(with_mask=False)
    model = tiny_model("qwen3", block_size=None, dtype=torch.float32)
    trainer = make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        max_steps=20,
        learning_rate=3e-3,
        block_size=3,
        ar_weight=0.5,
    )
    mask_id = tokenizer.mask_token_id
    assert tokenizer.mask_token == "<|mask|>" and model.config.mars["mask_token_id"] == mask_id
    before, batch = _fixed_batch_loss(trainer, model)
    trainer.train()
    after, _ = _fixed_batch_loss(trainer, model)
    assert after < before - 0.5, (before, after)
    logged = [entry for entry in trainer.state.log_history if "mars/noisy_loss" in entry]
    assert len(logged) == 20 and all("mars/clean_loss" in entry for entry in logged)
    for entry in logged:
        assert abs(entry["loss"] - (entry["mars/noisy_loss"] + 0.5 * entry["mars/clean_loss"])) < 1e-3

    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert reloaded.config.mars["block_size"] == 3
    assert reloaded.config.mars["mask_token_id"] == mask_id == reloaded_tokenizer.mask_token_id
    # The mask token is input-only: the saved generation config never lets it be generated.
    assert mask_id in reloaded.generation_config.suppress_tokens
    assert reloaded_tokenizer.mask_token == "<|mask|>"
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected)


def test_lora_trains_only_adapters_and_the_mask_row(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", tokenizer=tokenizer, dtype=torch.float32)
    original = copy.deepcopy(model)
    mask_id = model.config.mars["mask_token_id"]
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = make_trainer(
        tmp_path, model=model, tokenizer=tokenizer, peft_config=lora, max_steps=20, learning_rate=2e-2
    )
    trainable = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name or "trainable_tokens" in name for name in trainable), trainable
    assert any("trainable_tokens" in name for name in trainable)
    before, _ = _fixed_batch_loss(trainer, trainer.model)
    trainer.train()
    after, _ = _fixed_batch_loss(trainer, trainer.model)
    assert after < before - 0.2, (before, after)

    merged = trainer.model.merge_and_unload()
    new_embeddings = merged.get_input_embeddings().weight.detach()
    old_embeddings = original.get_input_embeddings().weight.detach()
    changed_rows = (new_embeddings != old_embeddings).any(-1).nonzero().flatten().tolist()
    assert changed_rows == [mask_id]
    old_params = dict(original.named_parameters())
    for name, param in merged.named_parameters():
        if "q_proj" in name or "v_proj" in name or "embed_tokens" in name:
            continue
        assert torch.equal(param, old_params[name]), name


def test_lora_mask_row_added_to_existing_trainable_token_indices(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", tokenizer=tokenizer, dtype=torch.float32)
    lora = LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [5]})
    make_trainer(tmp_path, model=model, tokenizer=tokenizer, peft_config=lora)
    assert sorted(lora.trainable_token_indices["embed_tokens"]) == [5, model.config.mars["mask_token_id"]]


def test_dataset_formats_supervise_the_right_tokens(tmp_path):
    tokenizer = tiny_tokenizer()
    # prompt/completion: completion-only loss by default
    trainer = make_trainer(tmp_path, tokenizer=tokenizer, dataset=prompt_completion_dataset())
    batch = next(iter(trainer.get_train_dataloader()))
    assistant_id = tokenizer.convert_tokens_to_ids("assistant")
    for row in range(batch["input_ids"].shape[0]):
        ids, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
        start = ids.index(assistant_id) + 1  # completion starts after "<|im_start|> assistant"
        assert all(label == -100 for label in labels[:start])
        assert labels[start] == ids[start]
    assert trainer.compute_loss(trainer.model, batch).item() > 0

    # messages + assistant_only_loss: a template with generation markers
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for message in messages %}<|im_start|> {{ message['role'] }} "
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }} <|im_end|> "
        "{% endgeneration %}{% else %}{{ message['content'] }} <|im_end|> {% endif %}{% endfor %}"
    )
    trainer = make_trainer(tmp_path, tokenizer=tokenizer, dataset=chat_dataset(), assistant_only_loss=True)
    batch = next(iter(trainer.get_train_dataloader()))
    user_id = tokenizer.convert_tokens_to_ids("user")
    for row in range(batch["input_ids"].shape[0]):
        ids, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
        user_at = ids.index(user_id)
        assert labels[user_at] == -100 and labels[user_at + 1] == -100
        assert any(label != -100 for label in labels)
    assert trainer.compute_loss(trainer.model, batch).item() > 0

    # plain text (language modeling), completion_only_loss=False on prompt/completion
    trainer = make_trainer(
        tmp_path, tokenizer=tiny_tokenizer(), dataset=prompt_completion_dataset(), completion_only_loss=False
    )
    batch = next(iter(trainer.get_train_dataloader()))
    real = batch["attention_mask"].bool()
    assert (batch["labels"][real] != -100).all()


def test_collator_pads_only_examples_that_end_with_eos():
    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id == eos  # the case that makes token-id padding detection wrong

    def base(examples):
        return {"examples": examples}

    collator = MARSDataCollator(collator=base, block_size=4, eos_token_id=eos, eos_tail_ids=(9,))
    examples = [
        {"input_ids": [5, 6, eos], "labels": [-100, 6, eos]},  # ends with EOS: padded to 4
        {"input_ids": [5, 6, 7, 8, 10], "labels": [-100, 6, 7, 8, 10]},  # cut at a length limit: untouched
        {"input_ids": [5, 6, eos, 9, 5, 6], "labels": [-100] * 6},  # EOS then other text: untouched
        {"input_ids": [5, eos, 9], "labels": [-100, eos, -100]},  # EOS + template tail: padded
        {"input_ids": [5, 6, 7, eos], "labels": [-100, 6, 7, eos]},  # already a multiple of 4
    ]
    out = collator(examples)["examples"]
    assert out[0] == {"input_ids": [5, 6, eos, eos], "labels": [-100, 6, eos, eos]}
    assert out[1] == examples[1]
    assert out[2] == examples[2]
    assert out[3] == {"input_ids": [5, eos, 9, eos], "labels": [-100, eos, -100, eos]}
    assert out[4] == examples[4]


def test_trainer_collator_padding_is_real_and_supervised(tmp_path):
    tokenizer = tiny_tokenizer()
    trainer = make_trainer(tmp_path, tokenizer=tokenizer, dataset=prompt_completion_dataset(4), block_size=5)
    assert isinstance(trainer.data_collator, MARSDataCollator)
    batch = next(iter(trainer.get_train_dataloader()))
    lengths = batch["attention_mask"].sum(1)
    assert (lengths % 5 == 0).all()
    eos = tokenizer.eos_token_id
    for row, length in enumerate(lengths.tolist()):
        assert batch["labels"][row, length - 1] == eos
    # Truncated examples (max_length cuts the EOS away) are not padded.
    trainer = make_trainer(
        tmp_path, tokenizer=tokenizer, dataset=prompt_completion_dataset(4), block_size=5, max_length=9
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["attention_mask"].sum(1) == 9).all()


def test_bf16_training_runs(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    trainer = make_trainer(tmp_path, model=model, bf16=True, max_steps=2)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


# --- clean_loss="kl_to_base" --------------------------------------------------------------------


@torch.no_grad()
def _definitional_kl(base_logits, model_logits, batch):
    """Σ over clean targets of KL(base ‖ model) of the next-token distributions, from plain causal runs.

    ``base_logits`` / ``model_logits`` map ``input_ids [1, t]`` to logits.
    """
    total = 0.0
    for row in range(batch["input_ids"].shape[0]):
        real = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row : row + 1, :real]
        base_logp = base_logits(ids)[0].double().log_softmax(-1)
        model_logp = model_logits(ids)[0].double().log_softmax(-1)
        for t in range(1, real):
            if batch["labels"][row, t] != -100:
                p = base_logp[t - 1]
                total += (p.exp() * (p - model_logp[t - 1])).sum().item()
    return total


def test_kl_to_base_with_lora_is_zero_at_init_then_matches_definition(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen2", tokenizer=tokenizer)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = make_trainer(
        tmp_path, model=model, tokenizer=tokenizer, peft_config=lora, clean_loss="kl_to_base"
    )
    peft_model = trainer.model
    batch = right_padded_batch(seed=11)
    n = int((batch["labels"][:, 1:] != -100).sum())

    trainer.args.ar_weight = 1.0
    kl_loss, kl_grads = _loss_and_grads(trainer, peft_model, batch)
    trainer.args.ar_weight = 0.0
    noisy_loss, noisy_grads = _loss_and_grads(trainer, peft_model, batch)
    # At init the adapter is the identity: the KL term and its gradient are 0.
    assert abs(kl_loss.item() - noisy_loss.item()) < 1e-12
    for name in noisy_grads:
        torch.testing.assert_close(kl_grads[name], noisy_grads[name], rtol=0, atol=1e-12)

    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    trainer.args.ar_weight = 1.0
    with torch.no_grad():
        kl_loss = trainer.compute_loss(peft_model, {k: v.clone() for k, v in batch.items()}).item()
        trainer.args.ar_weight = 0.0
        noisy_only = trainer.compute_loss(peft_model, {k: v.clone() for k, v in batch.items()}).item()
        trainer.args.clean_loss, trainer.args.ar_weight = "ce", 1.0
        ce_loss = trainer.compute_loss(peft_model, {k: v.clone() for k, v in batch.items()}).item()

    def base_logits(ids):
        with peft_model.disable_adapter():
            return peft_model(input_ids=ids).logits

    expected_kl = _definitional_kl(base_logits, lambda ids: peft_model(input_ids=ids).logits, batch)
    assert expected_kl > 1e-3
    assert abs((kl_loss - noisy_only) * n - expected_kl) < 1e-6
    assert abs(kl_loss - ce_loss) > 1e-3


def test_kl_to_base_full_finetune_uses_a_frozen_copy(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    original = copy.deepcopy(model)
    trainer = make_trainer(
        tmp_path, model=model, clean_loss="kl_to_base", max_steps=3, learning_rate=1e-2, ar_weight=1.0
    )
    assert trainer._base_model is not None
    assert not any(p.requires_grad for p in trainer._base_model.parameters())
    trainer.train()
    for (name, param), frozen in zip(original.named_parameters(), trainer._base_model.parameters()):
        assert torch.equal(param, frozen), name
    assert any(not torch.equal(a, b) for a, b in zip(original.parameters(), model.parameters()))
    logged = [entry for entry in trainer.state.log_history if "mars/clean_kl" in entry]
    assert logged and logged[0]["mars/clean_kl"] < 1e-6  # step 1: model == base
    # After training, the KL term is the definitional KL from the *starting* model.
    model.eval()
    batch = right_padded_batch(seed=2)
    n = int((batch["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        with_kl = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()}).item()
        trainer.args.ar_weight = 0.0
        noisy_only = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()}).item()
    expected = _definitional_kl(
        lambda ids: original(input_ids=ids).logits, lambda ids: model(input_ids=ids).logits, batch
    )
    assert expected > 1e-3
    assert abs((with_kl - noisy_only) * n - expected) < 1e-3 * max(1.0, expected)


def test_time_budget_sets_the_schedule_and_stops_training(tmp_path, monkeypatch):
    """max_train_minutes: the learning rate follows TimeBudget (linear in time, 0 at the budget) and
    training stops there, long before max_steps. A fake clock makes it independent of the host's speed."""
    from mars_hf.training.time_budget import TimeBudget

    clock = [0.0]

    def tick():  # every clock read advances one second
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr("mars_hf.training.time_budget.time.monotonic", tick)
    trainer = make_trainer(
        tmp_path, max_steps=500, max_train_minutes=0.5, warmup_steps=0.1, learning_rate=1e-3, logging_steps=1
    )
    trainer.train()
    assert isinstance(trainer.time_budget, TimeBudget) and trainer.time_budget.spent()
    assert 3 < trainer.state.global_step < 30  # 30 s of fake clock, a few reads per step
    rates = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    peak = rates.index(max(rates))
    assert 0 < peak and max(rates) <= 1e-3  # warm-up, then ...
    assert all(a >= b for a, b in zip(rates[peak:], rates[peak + 1 :]))  # ... a monotone decay
    assert rates[-1] < 0.2e-3


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"block_size": 0}, "block_size"),
        ({"ar_weight": -0.5}, "ar_weight"),
        ({"ar_weight": float("nan")}, "ar_weight"),
        ({"clean_loss": "mse"}, "clean_loss"),
        ({"packing": True}, "packing"),
        ({"max_train_minutes": 0}, "max_train_minutes"),
    ],
)
def test_bad_config_is_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **overrides)


def test_dataset_without_supervised_tokens_is_refused(tmp_path):
    tokenizer = tiny_tokenizer()
    ids = tokenizer("the cat sat on the mat <|im_end|>")["input_ids"]
    only_first = [ids[0]] + [-100] * (len(ids) - 1)  # a label at position 0 is not a target
    for labels in ([-100] * len(ids), only_first):
        dataset = Dataset.from_list([{"input_ids": ids, "labels": labels}] * 4)
        with pytest.raises(ValueError, match="no supervised token"):
            make_trainer(tmp_path, tokenizer=tokenizer, dataset=dataset, max_length=None)


def test_unsupported_attention_backend_is_refused(tmp_path):
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match='attn_implementation="sdpa"'):
        make_trainer(tmp_path, model=model)


def test_other_training_arguments_are_refused(tmp_path):
    from trl import SFTConfig

    with pytest.raises(TypeError, match="MARSConfig"):
        MARSTrainer(
            model=tiny_model("llama"),
            args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[]),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
        )


def test_evaluate_reports_the_mars_loss(tmp_path):
    model = tiny_model("llama")
    trainer = MARSTrainer(
        model=model,
        args=config(tmp_path, eval_strategy="no", per_device_eval_batch_size=4),
        train_dataset=chat_dataset(4),
        eval_dataset=prompt_completion_dataset(4),
        processing_class=tiny_tokenizer(),
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0
    assert (
        abs(metrics["eval_loss"] - (metrics["eval_mars/noisy_loss"] + metrics["eval_mars/clean_loss"])) < 1e-6
    )


def test_chat_template_tail_is_detected(caplog):
    from mars_hf.training.collator import chat_template_eos_tail

    tokenizer = tiny_tokenizer()
    assert chat_template_eos_tail(tokenizer) == ()  # the tiny template ends right on EOS
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|> ", "<|im_end|> x ")
    assert chat_template_eos_tail(tokenizer) == (tokenizer.convert_tokens_to_ids("x"),)
    tokenizer.chat_template = "{{ raise_exception('a system message is required') }}"
    with caplog.at_level(logging.WARNING, logger="mars_hf.training.collator"):
        assert chat_template_eos_tail(tokenizer) == ()
    assert "a system message is required" in caplog.text and "only examples whose very last token" in caplog.text


def test_lora_checkpoint_reloads_with_mask_token_and_config(tmp_path):
    from mars_hf import AutoMARSModelForCausalLM

    tokenizer = tiny_tokenizer(with_mask=False)
    base = tiny_model("llama", block_size=None, dtype=torch.float32)
    base.save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        peft_config=lora,
        max_steps=3,
        learning_rate=2e-2,
        block_size=3,
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    reloaded = AutoMARSModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    assert reloaded.config.mars["block_size"] == 3
    assert reloaded.config.mars["mask_token_id"] == reloaded_tokenizer.mask_token_id == trainer.mask_token_id
    batch = right_padded_batch(seed=4)
    batch["input_ids"][:, 2:4] = trainer.mask_token_id  # the trained mask row must come back too
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---- Dataset screening: rows that teach MARS nothing are counted, reported and dropped before training.
def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def screening_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "mars_hf.training.screening" and "dropped" in r.getMessage()]


def _no_rows():
    yield from ()


@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize(
    "empty",
    [
        lambda: Dataset.from_dict({"messages": []}),
        lambda: Dataset.from_list([]),
        lambda: IterableDataset.from_generator(_no_rows, features=Features({"text": Value("string")})),
    ],
)
def test_empty_dataset_is_refused_by_name(tmp_path, split, empty):
    """TRL reads the first row and raised a bare StopIteration; the refusal names the split and the fix."""
    datasets = {"train_dataset": chat_dataset(4), "eval_dataset": None}
    datasets[f"{split}_dataset"] = empty()
    with pytest.raises(ValueError, match=f"The {split} dataset is empty \\(0 rows\\)"):
        MARSTrainer(model=tiny_model("llama"), args=config(tmp_path), processing_class=tiny_tokenizer(), **datasets)


def test_rows_without_anything_to_learn_are_counted_dropped_and_training_runs(tmp_path, caplog):
    """Empty completions, chats without (or with empty) assistant turns: reported with counts, then real
    TRL + PEFT training on what is left."""
    good = chat_dataset(6).to_list()
    rows = good[:2] + [
        {"messages": [user("hello")]},  # no assistant turn
        {"messages": [user("the cat"), assistant(" ")]},  # empty assistant turn
        {"messages": [user("one"), assistant("")]},
        {"messages": [user("is the dog red")]},
    ] + good[2:]
    evaluation = prompt_completion_dataset(3).to_list() + [
        {"prompt": [user("hello")], "completion": [assistant("")]},
        {"prompt": [user("hello")], "completion": []},
    ]
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    with caplog.at_level(logging.WARNING, logger="mars_hf.training.screening"):
        trainer = make_trainer(
            tmp_path,
            dataset=Dataset.from_list(rows),
            eval_dataset=Dataset.from_list(evaluation),
            peft_config=lora,
            max_steps=2,
            per_device_train_batch_size=2,
        )
    warnings = screening_warnings(caplog)
    assert (
        "dropped 4 of 10 train rows that MARS cannot learn from: 2 with no assistant turn, "
        "2 whose assistant turns are all empty; 6 remain" in warnings[0]
    )
    assert "dropped 2 of 5 eval rows that MARS cannot learn from: 2 with an empty completion; 3 remain" in warnings[1]
    assert len(warnings) == 2
    assert trainer.train_dataset["messages"] == [row["messages"] for row in good]
    assert len(trainer.eval_dataset) == 3
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.evaluate()["eval_loss"] > 0


def test_empty_string_completions_are_dropped_not_trained_as_a_lone_eos(tmp_path, caplog):
    """TRL appends EOS to a '' completion and trained on that alone; with nothing else left it is refused."""
    rows = [{"prompt": "the cat sat", "completion": " one two three"}] * 3 + [{"prompt": "hello", "completion": ""}]
    with caplog.at_level(logging.WARNING, logger="mars_hf.training.screening"):
        trainer = make_trainer(tmp_path, dataset=Dataset.from_list(rows))
    assert "1 with an empty completion; 3 remain" in screening_warnings(caplog)[0]
    assert len(trainer.train_dataset) == 3
    with pytest.raises(ValueError, match="no row MARS can learn from: of its 2 rows, 2 with an empty completion"):
        make_trainer(tmp_path, dataset=Dataset.from_list([{"prompt": "hello", "completion": ""}] * 2))


def test_chat_rows_truncated_to_their_prompt_are_dropped_at_the_exact_boundary(tmp_path, caplog):
    """`messages` rows supervise every token, so TRL kept a row cut to its prompt and trained on it. The row
    is dropped when max_length ends before the first assistant token and kept when that token fits."""
    tokenizer = tiny_tokenizer()
    long_row = {"messages": [user(" ".join(["the cat sat on the mat"] * 6)), assistant("yes no")]}
    prompt = tokenizer.apply_chat_template(long_row["messages"][:1], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    short = [{"messages": [user("hello"), assistant("one two")]}] * 3
    dataset = Dataset.from_list(short + [long_row])
    with caplog.at_level(logging.WARNING, logger="mars_hf.training.screening"):
        cut = make_trainer(tmp_path, tokenizer=tokenizer, dataset=dataset, max_length=len(prompt))
    assert (
        f"dropped 1 of 4 train rows that MARS cannot learn from: 1 cut to prompt tokens only by truncation at "
        f"max_length={len(prompt)}; 3 remain" in screening_warnings(caplog)[0]
    )
    assert len(cut.train_dataset) == 3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mars_hf.training.screening"):
        kept = make_trainer(tmp_path, tokenizer=tokenizer, dataset=dataset, max_length=len(prompt) + 1)
    assert not screening_warnings(caplog)
    row = [ids for ids in kept.train_dataset["input_ids"] if len(ids) == len(prompt) + 1]
    assert row == [prompt + [tokenizer.convert_tokens_to_ids("yes")]]  # one assistant token survived
    with pytest.raises(ValueError, match="of its 1 rows, 1 cut to prompt tokens only by truncation"):
        make_trainer(tmp_path, tokenizer=tokenizer, dataset=Dataset.from_list([long_row]), max_length=len(prompt))


def test_chat_rows_truncated_from_the_start_keep_end_are_judged_by_their_last_assistant_turn(tmp_path, caplog):
    tokenizer = tiny_tokenizer()
    tail = " ".join(["the cat sat on the mat"] * 6)
    row = {"messages": [user("hello"), assistant("yes"), user(tail)]}  # a long user turn after the answer
    full = len(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
    until_answer = len(
        tokenizer.apply_chat_template(row["messages"][:2], tokenize=True, return_dict=True)["input_ids"]
    )
    dataset = Dataset.from_list([row] + [{"messages": [user("hello"), assistant("one two")]}] * 3)
    for max_length, dropped in ((full - until_answer, True), (full - until_answer + 1, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mars_hf.training.screening"):
            make_trainer(tmp_path, dataset=dataset, max_length=max_length, truncation_mode="keep_end")
        assert bool(screening_warnings(caplog)) == dropped, max_length


def test_prompt_completion_rows_truncation_empties_are_counted(tmp_path, caplog):
    """TRL filtered them out silently; the count now says how many and why."""
    long_prompt = [user(" ".join(["the cat sat on the mat"] * 6))]
    rows = prompt_completion_dataset(3).to_list() + [{"prompt": long_prompt, "completion": [assistant("yes")]}] * 2
    with caplog.at_level(logging.WARNING, logger="mars_hf.training.screening"):
        trainer = make_trainer(tmp_path, dataset=Dataset.from_list(rows), max_length=24)
    assert (
        "dropped 2 of 5 train rows that MARS cannot learn from: 2 cut to no supervised token by truncation at "
        "max_length=24; 3 remain" in screening_warnings(caplog)[0]
    )
    assert len(trainer.train_dataset) == 3


def test_tokenized_rows_without_a_target_are_dropped_and_training_runs(tmp_path, caplog):
    """Empty rows made a batch of float input ids (a RuntimeError inside the embedding) a step later."""
    good = {"input_ids": [5, 6, 7, 8, 2], "labels": [-100, 6, 7, 8, 2]}
    rows = [{"input_ids": [], "labels": []}] * 4 + [{"input_ids": [5, 6], "labels": [5, -100]}] + [good] * 4
    with caplog.at_level(logging.WARNING, logger="mars_hf.training.screening"):
        trainer = make_trainer(
            tmp_path, dataset=Dataset.from_list(rows), max_length=None, max_steps=3, per_device_train_batch_size=2
        )
    assert (
        "dropped 5 of 9 train rows that MARS cannot learn from: 5 with no supervised token past the first "
        "position; 4 remain" in screening_warnings(caplog)[0]
    )
    assert trainer.train_dataset["input_ids"] == [good["input_ids"]] * 4
    trainer.train()
    assert trainer.state.global_step == 3
