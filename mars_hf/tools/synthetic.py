"""A synthetic, highly predictable chat language, and a tiny model trained on it with `MARSTrainer`.

Why: how much MARS speeds decoding up depends on how many tokens the model is confident about. The
untrained SmolLM2 accepts about one token per step, so benchmarks and end-to-end tests also need a
model whose continuations are (almost) certain. Counting is such a language:
once the prompt is read, every answer token is determined, so a tiny model trained for about a
minute on a CPU accepts several tokens per forward.

The tokenizer is word level (one token per word or number) with a ChatML-like template whose padding
token *is* its EOS token, like SmolLM2's, so the padding rules of the real model are exercised too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
KEYWORDS = "system user assistant count from to down please".split()
MAX_NUMBER = 99
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# Bump when the language, the tokenizer, the model shape or the training recipe changes: the cached
# trained model is keyed by it.
SYNTHETIC_VERSION = 2


def synthetic_vocabulary() -> list[str]:
    return SPECIAL_TOKENS + KEYWORDS + [str(i) for i in range(MAX_NUMBER + 1)]


def word_level_chat_tokenizer(vocabulary: list[str], chat_template: str, mask_token: str | None = None):
    """A real word-level fast tokenizer over ``vocabulary`` (ids in list order), pad == EOS == ``<|im_end|>``.

    Shared by the synthetic language and the tests' tiny models: no download, exact ids. The mask
    token keeps its vocabulary id when listed there, else it is added after the vocabulary.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(vocabulary)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        bos_token=None,
    )
    tokenizer.chat_template = chat_template
    tokenizer.padding_side = "left"
    if mask_token is not None:
        tokenizer.add_special_tokens({"mask_token": mask_token})
    return tokenizer


def synthetic_tokenizer():
    """Word-level tokenizer of the synthetic language: pad == EOS == ``<|im_end|>``, mask ``<|mask|>``."""
    return word_level_chat_tokenizer(synthetic_vocabulary(), CHAT_TEMPLATE, MASK_TOKEN)


def synthetic_pair(rng: random.Random) -> tuple[str, str]:
    """One (user message, assistant answer) pair; the answer is a function of the message.

    Counting up or down between two numbers: every answer token is determined, yet the model must
    read the prompt to start and to stop. (Repeating a pattern a given number of times was tried
    too; a model this small does not learn to count repetitions in a minute.)"""
    task = rng.choice(["up", "up", "down"])
    span = rng.randint(5, 60)
    low = rng.randint(0, MAX_NUMBER - span)
    numbers = list(range(low, low + span + 1))
    if task == "down":
        numbers.reverse()
        prompt = f"count down from {numbers[0]} to {numbers[-1]}"
    else:
        prompt = f"count from {numbers[0]} to {numbers[-1]}"
    if rng.random() < 0.3:
        prompt = "please " + prompt
    return prompt, " ".join(map(str, numbers))


def synthetic_examples(num_examples: int, seed: int = 0) -> list[dict]:
    """Conversational prompt/completion examples (TRL's format: only the completion is supervised)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        prompt, answer = synthetic_pair(rng)
        examples.append(
            {
                "prompt": [{"role": "user", "content": prompt}],
                "completion": [{"role": "assistant", "content": answer}],
            }
        )
    return examples


def synthetic_prompts(num_prompts: int = 8, seed: int = 1234) -> list[str]:
    """User messages for benchmarks (a seed different from training's, so not copies of it)."""
    rng = random.Random(seed)
    return [synthetic_pair(rng)[0] for _ in range(num_prompts)]


def synthetic_model_config(tokenizer, **overrides):
    """A small Llama: big enough to learn the language in about a minute of CPU training."""
    from transformers import LlamaConfig

    config = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    config.update(overrides)
    return LlamaConfig(**config)


def _training_recipe(block_size: int, max_steps: int, seed: int) -> dict:
    return {
        "version": SYNTHETIC_VERSION,
        "block_size": block_size,
        "max_steps": max_steps,
        "seed": seed,
        "num_examples": 4096,
        "batch_size": 32,
        "learning_rate": 3e-3,
    }


def synthetic_model_dir(block_size: int = 4, max_steps: int = 400, seed: int = 0) -> Path:
    """Where the trained synthetic model is cached (under ``$MARS_HF_HOME``, keyed by the recipe)."""
    from mars_hf.models.embedded_model import mars_hf_home

    recipe = _training_recipe(block_size, max_steps, seed)
    key = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    return mars_hf_home() / f"synthetic-b{block_size}-{key}"


def train_synthetic_model(
    output_dir: str | os.PathLike | None = None,
    *,
    block_size: int = 4,
    max_steps: int = 400,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
):
    """Train a tiny Llama on the synthetic language with `MARSTrainer`; returns ``(model, tokenizer)``.

    With ``output_dir`` the model and tokenizer are saved there (``save_pretrained``), carrying the
    mask token and ``config.mars`` like any MARS checkpoint.
    """
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from mars_hf.training.config import MARSConfig
    from mars_hf.training.trainer import MARSTrainer

    recipe = _training_recipe(block_size, max_steps, seed)
    tokenizer = synthetic_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(synthetic_model_config(tokenizer), dtype=torch.float32)
    dataset = Dataset.from_list(synthetic_examples(recipe["num_examples"], seed=seed))
    with tempfile.TemporaryDirectory() as scratch:
        args = MARSConfig(
            output_dir=scratch,
            block_size=block_size,
            max_steps=max_steps,
            per_device_train_batch_size=recipe["batch_size"],
            learning_rate=recipe["learning_rate"],
            lr_scheduler_type="cosine",
            warmup_steps=max(1, max_steps // 20),
            weight_decay=0.0,
            logging_steps=max(1, max_steps // 10),
            disable_tqdm=not progress,
            save_strategy="no",
            report_to="none",
            seed=seed,
            bf16=False,
            fp16=False,
            use_cpu=True,
            gradient_checkpointing=False,  # TRL's default; only costs time on a model this small
            max_length=128,
            dataloader_num_workers=0,
        )
        trainer = MARSTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
        model = trainer.model
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if output_dir is not None:
        output_dir = Path(output_dir)
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        (output_dir / "synthetic_recipe.json").write_text(json.dumps(recipe, indent=2))
    return model, tokenizer


def load_synthetic_model(block_size: int = 4, max_steps: int = 400, seed: int = 0, dtype=torch.float32):
    """The trained synthetic model, trained once and then cached (see `synthetic_model_dir`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = synthetic_model_dir(block_size, max_steps, seed)
    if not (target / "config.json").exists():
        logger.info("Training the synthetic MARS model once (about a minute); cached in %s.", target)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        train_synthetic_model(tmp, block_size=block_size, max_steps=max_steps, seed=seed)
        if not target.exists():
            tmp.replace(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    return model, tokenizer
