"""``mars-hf export --for vllm``: the folder, the refusals, and vLLM's parallel-drafting step replayed.

The contract, read from vLLM 0.33.0 (the sdist on PyPI, ``vllm-0.33.0.tar.gz``; line numbers are its;
``llm_base_proposer.py`` of vllm-project/vllm at commit 00c4f22dae4795e34658bead82fa071e6bb7ae39 has the
same mask-id lookup and input preparation):

* ``vllm/config/speculative.py`` l. 511: ``parallel_drafting: bool`` ("Only compatible with EAGLE and
  draft model methods"); l. 2040-2055 ``verify_equal_vocab_size_if_draft_model``: for
  ``method == "draft_model"`` the target's and drafter's ``get_vocab_size()`` (``vllm/config/model.py``
  l. 1629, ``vllm/transformers_utils/model_arch_config_convertor.py`` l. 85-86: the text config's
  ``vocab_size``) must be equal.
* ``vllm/v1/spec_decode/draft_model.py`` l. 19-31: ``DraftModelProposer`` is a
  ``SpecDecodeBaseProposer`` with ``pass_hidden_states_to_model=False``; l. 114-122: it shares neither
  embeddings nor lm_head with the target (so the drafter's own trained mask row is used).
* ``vllm/v1/spec_decode/llm_base_proposer.py`` l. 112-119: with ``parallel_drafting`` each request
  gets ``K`` extra slots (``K = num_speculative_tokens``), none taken back (no hidden states);
  l. 355-379 ``_init_parallel_drafting_params``: the slot token is ``dflash_config.mask_token_id``, else
  ``mask_token_id``, ``dspark_noise_token_id``, ``pard_token``, ``ptd_token_id`` of the drafter's
  ``config.json`` (the stored older revision 82720b1ed4712ddebb597acdbcff752db48a76c1 reads only
  ``dflash_config``, ``pard_token``, ``ptd_token_id``: the export writes all three plain keys);
  l. 876-915 ``set_inputs_first_pass`` runs ``_copy_and_expand_eagle_inputs`` with
  ``padding_token_id=0``, ``num_padding_slots_per_request=K``, ``shift_input_ids=False``;
  l. 614 and 627-636: one forward, then the hidden states at ``token_indices_to_sample`` give all K
  drafts (``view(-1, K)``); l. 437-447 ``_greedy_sample``: ``compute_logits(...).argmax(-1)``.
* ``vllm/v1/spec_decode/utils.py`` l. 429-574 ``copy_and_expand_eagle_inputs_kernel``: per request,
  output slots ``j`` hold the accepted query tokens (``j < num_valid``), the bonus token
  (``j == num_valid``), the parallel-drafting token (``num_valid < j < num_valid + K``) and, last, the
  rejected slots (token 0, position 0); positions are ``start_pos + j``; the K sampled slots are
  ``j = num_valid ... num_valid + K - 1`` (0 = bonus, then the masks). l. 363-391
  ``compute_new_slot_mapping``: only rejected slots skip the KV cache, so mask slots do write keys and
  values — at positions the next step writes again (its query starts at this step's bonus) before any
  real token reads them. Hence the cached context is exactly the keys/values of the real tokens.

``vllm_parallel_drafting_step`` below ports the kernel's layout and runs the drafter once over the
flattened batch (each request's cached context followed by its slots, a block-diagonal causal mask:
what the paged cache and ``query_start_loc`` give the attention). The test checks that these drafts
equal mars_hf's own predictions for the same prefix (``accepted + bonus``): ``generate`` with window
``W = K - 1`` and τ = 0, whose first step emits the last real token's prediction and the W mask
predictions. This machine has no GPU and no vLLM wheel for its CPU: vLLM itself is not run here.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_hf.cli import main as cli_main
from mars_hf.hub.export import (
    VLLM_MASK_KEYS,
    ExportRefusedError,
    export_for_vllm,
    read_drafter_mask_token_like_vllm,
    vocab_size_like_vllm,
)
from mars_hf.models.embedded_model import embedded_model_dir
from mars_hf.models.mask_token import add_mask_token, set_mars_config
from mars_hf.models.modeling import load_mars_model
from tests.tiny import tiny_model, tiny_tokenizer

K_VALUES = [1, 2, 4, 8]
BLOCK_SIZE = 4
SMOLLM2_VOCAB = 49152


# ------------------------------------------------------------------------------------------ vLLM, replayed
def vllm_copy_and_expand(target_token_ids, target_positions, query_start_loc, num_rejected, next_token_ids, k, mask_id):
    """``copy_and_expand_eagle_inputs_kernel`` (utils.py l. 429-574) with ``shift_input_ids=False``,
    ``num_padding_slots_per_request=k``, ``padding_token_id=0``, in plain Python."""
    batch = len(next_token_ids)
    total = len(target_token_ids) + k * batch
    input_ids, positions = [None] * total, [None] * total
    is_rejected, is_masked = [False] * total, [False] * total
    request_of = [None] * total
    token_indices_to_sample = [None] * (k * batch)
    for r in range(batch):
        start, next_start = query_start_loc[r], query_start_loc[r + 1]
        end = next_start - 1 - num_rejected[r]  # query_end_loc (llm_base_proposer.py l. 887-890)
        num_valid = end - start + 1
        rejected = next_start - end - 1
        out_start = start + r * k
        start_pos = target_positions[start]
        for j in range(num_valid + k + rejected):
            out = out_start + j
            request_of[out] = r
            if j < num_valid:
                token, position = target_token_ids[start + j], start_pos + j
            elif j == num_valid:
                token, position = next_token_ids[r], start_pos + j
            elif j < num_valid + k:
                token, position = mask_id, start_pos + j
                is_masked[out] = True
            else:
                token, position = 0, 0
                is_rejected[out] = True
            input_ids[out], positions[out] = token, position
            if num_valid <= j < num_valid + k:
                token_indices_to_sample[r * k + j - num_valid] = out
    assert None not in input_ids and None not in token_indices_to_sample
    return dict(
        input_ids=input_ids,
        positions=positions,
        is_rejected=is_rejected,
        is_masked=is_masked,
        request_of=request_of,
        token_indices_to_sample=token_indices_to_sample,
    )


@torch.no_grad()
def vllm_parallel_drafting_step(drafter, requests, k, mask_id):
    """One drafter step of vLLM's ``draft_model`` + ``parallel_drafting``: ``[batch, k]`` drafts, the
    ``[batch, k, vocab]`` logits of the sampled slots, and the layout.

    ``requests``: dicts with ``context`` (tokens already in the drafter's KV cache), ``query`` (this
    step's target query: the prompt at prefill, else last bonus + the K drafts), ``num_rejected`` and
    ``bonus`` (the target's sampled token).
    """
    target_token_ids, target_positions, query_start_loc = [], [], [0]
    for request in requests:
        target_token_ids += request["query"]
        target_positions += range(len(request["context"]), len(request["context"]) + len(request["query"]))
        query_start_loc.append(len(target_token_ids))
    layout = vllm_copy_and_expand(
        target_token_ids,
        target_positions,
        query_start_loc,
        [request["num_rejected"] for request in requests],
        [request["bonus"] for request in requests],
        k,
        mask_id,
    )
    # One packed sequence: request r's cached context (positions 0..start-1), then its slots.
    tokens, positions, segment, cached, slot_at = [], [], [], [], {}
    for r, request in enumerate(requests):
        tokens += request["context"]
        positions += range(len(request["context"]))
        segment += [r] * len(request["context"])
        cached += [True] * len(request["context"])
        for out, owner in enumerate(layout["request_of"]):
            if owner == r:
                slot_at[out] = len(tokens)
                tokens.append(layout["input_ids"][out])
                positions.append(layout["positions"][out])
                segment.append(r)
                cached.append(not layout["is_rejected"][out])  # rejected slots write no KV (PADDING_SLOT_ID)
    n = len(tokens)
    seg = torch.tensor(segment)
    order = torch.arange(n)
    visible = (seg[:, None] == seg[None, :]) & (order[:, None] >= order[None, :]) & torch.tensor(cached)[None, :]
    visible |= torch.eye(n, dtype=torch.bool)  # a rejected slot's own (discarded) row must not be empty
    logits = drafter(
        input_ids=torch.tensor([tokens]),
        position_ids=torch.tensor([positions]),
        attention_mask=visible[None, None],
    ).logits[0]
    sampled = logits[torch.tensor([slot_at[out] for out in layout["token_indices_to_sample"]])]
    drafts = sampled.argmax(dim=-1).view(-1, k).tolist()  # _greedy_sample, then view(-1, K)
    return drafts, sampled.view(len(requests), k, -1), layout


def draft_requests(vocab_size, mask_id, k, seed=0):
    """Four requests of different lengths: a prefill, and decode steps with 1, all and none of the K
    previous drafts accepted."""
    generator = torch.Generator().manual_seed(seed + k)

    def tokens(count):
        ids = torch.randint(3, vocab_size, (count,), generator=generator).tolist()
        return [t if t != mask_id else t + 1 for t in ids]

    requests = [dict(context=[], query=tokens(4), num_rejected=0)]
    for context, accepted in ((9, min(1, k)), (14, k), (6, 0)):
        requests.append(dict(context=tokens(context), query=tokens(k + 1), num_rejected=k - accepted))
    for request in requests:
        request["bonus"] = tokens(1)[0]
        valid = len(request["query"]) - request["num_rejected"]
        request["prefix"] = request["context"] + request["query"][:valid] + [request["bonus"]]
    return requests


@torch.no_grad()
def mars_hf_predictions(model, prefixes, k, pad_token_id):
    """mars_hf's own first-step predictions for each prefix (the last real token's and the W = k - 1
    masks'), and their logits (``output_logits``, float32)."""
    width = max(map(len, prefixes))
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prefixes])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes])
    window = dict(mars_threshold=1.0) if k == 1 else dict(mars_threshold=0.0, mars_block_size=k - 1)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=k,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
        **window,
    )
    assert out.sequences.shape[1] == width + k
    return out.sequences[:, width:].tolist(), torch.stack(out.logits, dim=1)


# ------------------------------------------------------------------------------------------ checkpoints
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def smollm2_shaped(**overrides):
    return tiny_model(
        "llama",
        block_size=None,
        vocab_size=SMOLLM2_VOCAB,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **overrides,
    )


def build(arch, folder, placement="keep_vocab_size"):
    """(target folder, MARS checkpoint folder, mask id): a base model and its MARS fine-tune."""
    if arch == "smollm2":
        tokenizer, base = smollm2_tokenizer(), smollm2_shaped()
    else:
        tokenizer, base = tiny_tokenizer(with_mask=False), tiny_model("qwen2", block_size=None)
    with torch.no_grad():  # sharper logits, so that predictions depend on the context and position
        base.get_output_embeddings().weight.mul_(30.0)
    target = folder / "target"
    base.save_pretrained(target)
    tokenizer.save_pretrained(target)
    model = copy.deepcopy(base)
    mask_id = add_mask_token(model, tokenizer, placement=placement)
    with torch.no_grad():  # stands in for training: the mask row is the MARS model's own
        generator = torch.Generator().manual_seed(7)
        weight = model.get_input_embeddings().weight
        weight[mask_id] += weight.std() * torch.randn(weight.shape[1], generator=generator, dtype=weight.dtype)
    set_mars_config(model, block_size=BLOCK_SIZE, mask_token_id=mask_id)
    checkpoint = folder / "mars"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    return target, checkpoint, mask_id


@pytest.fixture(scope="module", params=["smollm2", "qwen2"])
def exported(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    target, checkpoint, mask_id = build(request.param, folder)
    out = export_for_vllm(checkpoint, folder / "drafter", target=str(target))
    return dict(arch=request.param, target=target, checkpoint=checkpoint, out=out, mask_id=mask_id)


# ------------------------------------------------------------------------------------------ tests
def test_exported_folder_reads_like_vllm(exported):
    out, target = exported["out"], exported["target"]
    config = json.loads((out / "config.json").read_text())
    target_config = json.loads((target / "config.json").read_text())
    # vLLM's vocab check (speculative.py l. 2040-2055) passes, with the base vocabulary unchanged.
    expected_vocab = SMOLLM2_VOCAB if exported["arch"] == "smollm2" else 64
    assert vocab_size_like_vllm(config) == vocab_size_like_vllm(target_config) == expected_vocab
    assert read_drafter_mask_token_like_vllm(out) == exported["mask_id"]
    assert all(config[key] == exported["mask_id"] for key in VLLM_MASK_KEYS)
    if exported["arch"] == "smollm2":  # no spare row: an unused special token became the mask
        assert exported["mask_id"] == 16
    else:  # Qwen2-shaped: the first spare row
        assert exported["mask_id"] == len(tiny_tokenizer(with_mask=False))
    assert config["architectures"] == target_config["architectures"]  # a stock architecture vLLM knows
    assert config["mars"]["vllm_export"]["drafter_only_merge"] is False
    assert not (out / "adapter_config.json").exists() and (out / "tokenizer.json").exists()
    assert AutoTokenizer.from_pretrained(out).mask_token_id == exported["mask_id"]
    # The weights are the checkpoint's, mask row included.
    source = AutoModelForCausalLM.from_pretrained(exported["checkpoint"], dtype=torch.float64).state_dict()
    drafter = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).state_dict()
    assert source.keys() == drafter.keys() and all(torch.equal(source[key], drafter[key]) for key in source)


@pytest.mark.parametrize("k", K_VALUES)
def test_vllm_parallel_drafts_equal_mars_hf_mask_predictions(exported, k):
    drafter = AutoModelForCausalLM.from_pretrained(exported["out"], dtype=torch.float64).eval()
    mask_id = read_drafter_mask_token_like_vllm(exported["out"])  # what vLLM feeds in the mask slots
    requests = draft_requests(drafter.config.vocab_size, mask_id, k)
    drafts, logits, layout = vllm_parallel_drafting_step(drafter, requests, k, mask_id)
    assert sum(layout["is_masked"]) == (k - 1) * len(requests)
    assert len({len(r["prefix"]) for r in requests}) == len(requests)  # rows of different lengths

    model, _ = load_mars_model(exported["checkpoint"], dtype=torch.float64)
    model.generation_config.suppress_tokens = None  # vLLM's draft argmax suppresses nothing
    ours, our_logits = mars_hf_predictions(model, [r["prefix"] for r in requests], k, pad_token_id=0)
    assert drafts == ours
    # The logits too (a position off by one changes them long before it changes a random model's argmax).
    torch.testing.assert_close(logits.to(our_logits.dtype), our_logits, rtol=0.0, atol=1e-5)


def test_replayed_layout_matches_the_kernel_by_hand():
    """A hand-written case of the kernel's layout (utils.py l. 489-556): 2 requests, K = 3."""
    layout = vllm_copy_and_expand(
        target_token_ids=[10, 11, 12, 20, 21, 22, 23],
        target_positions=[5, 6, 7, 0, 1, 2, 3],
        query_start_loc=[0, 3, 7],
        num_rejected=[1, 0],
        next_token_ids=[99, 98],
        k=3,
        mask_id=7,
    )
    assert layout["input_ids"] == [10, 11, 99, 7, 7, 0, 20, 21, 22, 23, 98, 7, 7]
    assert layout["positions"] == [5, 6, 7, 8, 9, 0, 0, 1, 2, 3, 4, 5, 6]
    assert layout["token_indices_to_sample"] == [2, 3, 4, 10, 11, 12]
    assert layout["is_rejected"] == [False] * 5 + [True] + [False] * 7


def test_gated_adapter_is_refused_or_merged_everywhere_for_a_drafter(tmp_path):
    from peft import LoraConfig, get_peft_model

    from mars_hf import hub
    from mars_hf.models.gated_peft import gate_peft_model

    tokenizer = tiny_tokenizer(with_mask=False)
    base = tiny_model("qwen2", block_size=None)
    mask_id = add_mask_token(base, tokenizer, placement="spare_row")
    set_mars_config(base, block_size=BLOCK_SIZE, mask_token_id=mask_id)
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    settings = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    gated = get_peft_model(copy.deepcopy(base), LoraConfig(**settings))
    torch.manual_seed(1)
    everywhere = get_peft_model(copy.deepcopy(base), LoraConfig(**settings)).eval()  # same LoRA, ungated
    gate_peft_model(gated, mask_id)
    checkpoint = tmp_path / "ckpt"
    hub.save_pretrained(gated.eval(), tokenizer, checkpoint, base_model=str(base_dir))

    with pytest.raises(ExportRefusedError, match="gated to mask positions.*--drafter-only-merge"):
        export_for_vllm(checkpoint, tmp_path / "refused", base_model_name_or_path=str(base_dir))
    assert not (tmp_path / "refused").exists()

    out = export_for_vllm(
        checkpoint, tmp_path / "drafter", base_model_name_or_path=str(base_dir), drafter_only_merge=True
    )
    config = json.loads((out / "config.json").read_text())
    assert config["mars"]["vllm_export"]["drafter_only_merge"] is True and "adapter_gating" not in config["mars"]
    assert vocab_size_like_vllm(config) == 64 and read_drafter_mask_token_like_vllm(out) == mask_id
    drafter = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, mask_id, mask_id, mask_id]])
    with torch.no_grad():
        merged, ungated = drafter(input_ids=ids).logits, everywhere(input_ids=ids).logits
        base_logits, gated_logits = base(input_ids=ids).logits, gated(input_ids=ids).logits
    # The merged drafter is the adapter applied at every position (PEFT's own ungated forward) ...
    torch.testing.assert_close(merged, ungated, rtol=1e-9, atol=1e-9)
    # ... so its one-token predictions at real positions are no longer the base model's (the gated
    # model's are), and its mask predictions differ from the gated model's.
    assert torch.equal(gated_logits[:, :5], base_logits[:, :5])
    assert not torch.allclose(merged[:, :5], base_logits[:, :5])
    assert not torch.allclose(merged[:, 5:], gated_logits[:, 5:])


def test_ungated_lora_adapter_is_merged_exactly(tmp_path):
    from peft import LoraConfig, get_peft_model

    from mars_hf import hub

    tokenizer = tiny_tokenizer(with_mask=False)
    base = tiny_model("qwen2", block_size=None)
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)  # the target: no mask token in its tokenizer
    mask_id = add_mask_token(base, tokenizer, placement="keep_vocab_size")
    set_mars_config(base, block_size=BLOCK_SIZE, mask_token_id=mask_id)
    torch.manual_seed(2)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(base, config).eval()
    checkpoint = tmp_path / "ckpt"
    hub.save_pretrained(peft_model, tokenizer, checkpoint, base_model=str(base_dir))
    out = export_for_vllm(checkpoint, tmp_path / "drafter", base_model_name_or_path=str(base_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["mars"]["vllm_export"] == {"drafter_only_merge": False, "source": str(checkpoint), "target": str(base_dir)}
    assert vocab_size_like_vllm(config) == 64 and read_drafter_mask_token_like_vllm(out) == mask_id
    drafter = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    ids = torch.tensor([[5, 6, 7, 8, mask_id, mask_id]])
    with torch.no_grad():
        torch.testing.assert_close(drafter(input_ids=ids).logits, peft_model(input_ids=ids).logits, rtol=1e-9, atol=1e-9)


def test_refuses_mismatched_vocabularies(tmp_path):
    # SmolLM2 has no spare row: the default placement grows the vocabulary to 49153 rows.
    target, checkpoint, _ = build("smollm2", tmp_path, placement="append")
    assert json.loads((checkpoint / "config.json").read_text())["vocab_size"] == SMOLLM2_VOCAB + 1
    with pytest.raises(ExportRefusedError, match="grew the vocabulary from 49152 to 49153.*keep_vocab_size"):
        export_for_vllm(checkpoint, tmp_path / "a")
    with pytest.raises(ExportRefusedError, match="vocab_size is 49153 but the target .* has 49152.*keep_vocab_size"):
        export_for_vllm(checkpoint, tmp_path / "b", target=str(target))

    # Same size, different token ids: vLLM would load it and draft garbage; we refuse.
    target, checkpoint, _ = build("qwen2", tmp_path / "q")
    other = tmp_path / "other"
    AutoModelForCausalLM.from_pretrained(target).save_pretrained(other)
    words = tiny_tokenizer(with_mask=False).get_vocab()
    from mars_hf.tools.synthetic import word_level_chat_tokenizer
    from tests.tiny import CHAT_TEMPLATE

    shuffled = sorted(words, key=lambda w: (words[w] < 3, w), reverse=True)  # specials first, words reordered
    word_level_chat_tokenizer(shuffled, CHAT_TEMPLATE).save_pretrained(other)
    with pytest.raises(ExportRefusedError, match="disagrees with the target .* token ids"):
        export_for_vllm(checkpoint, tmp_path / "c", target=str(other))
    assert not (tmp_path / "c").exists()


def test_refuses_missing_mask_fields_and_names_the_fix(tmp_path):
    plain = tmp_path / "plain"
    tiny_model("qwen2", block_size=None).save_pretrained(plain)
    tiny_tokenizer(with_mask=False).save_pretrained(plain)
    with pytest.raises(ValueError, match="add_mask_token"):
        export_for_vllm(plain, tmp_path / "out", block_size=4)
    # A drafter folder without the keys is refused the way vLLM refuses it, plus the fix.
    with pytest.raises(ExportRefusedError, match="pard_token.*ptd_token_id.*mars-hf export --for vllm"):
        read_drafter_mask_token_like_vllm(plain)


def test_cli(tmp_path, capsys):
    target, checkpoint, mask_id = build("qwen2", tmp_path)
    out = tmp_path / "drafter"
    assert cli_main(["export", str(checkpoint), "--for", "vllm", "--out", str(out), "--target", str(target)]) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {target}" in printed and '"parallel_drafting": true' in printed
    assert '"num_speculative_tokens": 5' in printed and read_drafter_mask_token_like_vllm(out) == mask_id
    assert cli_main(["export", str(checkpoint), "--for", "vllm", "--out", str(out)]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err
