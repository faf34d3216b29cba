"""MARS on transformers' fast path: a ``MARSStaticCache`` (``cache_implementation="static"``) and the forward
compiled as transformers compiles it (``compile_config``).

Every rule against the slow, obviously right computation: stock greedy ``generate`` (τ = 1 and verify must equal
it token for token, float64), MARS on the dynamic cache (τ < 1 must equal it: the static cache changes where
entries live, never what a step sees), a gated adapter's real positions (bit-equal to the base model, eager and
traced). Compiling costs tens of seconds per graph on two cores: one compiled test counts the graphs it made.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import CompileConfig

from mars_hf.decoding import gated_lora
from mars_hf.decoding.cache import MARSStaticCache
from mars_hf.decoding.cost_model import CostTable
from mars_hf.decoding.decoder import widest_step
from mars_hf.decoding.gated_lora import AdaptedLinear
from mars_hf.decoding.generation import enable_mars, static_capacity
from mars_hf.decoding.settings import MARSDecodingSettings
from tests.tiny import ARCHITECTURES, tiny_model, tiny_tokenizer

MODES = [
    dict(mars_threshold=1.0),
    dict(mars_acceptance="verify"),
    dict(mars_acceptance="verify", mars_layout="quadratic"),
]


def left_padded(batch=3, seed=0, lengths=(9, 5, 7), vocab=60, mask=None):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((batch, width), 2, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for b, n in enumerate(lengths[:batch]):
        row = torch.randint(3, vocab, (n,), generator=generator)
        if mask is not None:
            row = row.masked_fill(row == mask, 5)
        ids[b, width - n :] = row
        attention[b, width - n :] = 1
    return ids, attention


def gated(model, mask_token_id, rank=4, seed=1):
    """``model`` with a random mask-gated LoRA on every attention and MLP linear (the runtime the loaders attach)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] != "lm_head":
            pairs[name] = dict(
                A=0.5 * torch.randn(rank, module.in_features, generator=generator, dtype=torch.float64),
                B=0.5 * torch.randn(module.out_features, rank, generator=generator, dtype=torch.float64),
            )
    gate = gated_lora.install_mask_gate(model, mask_token_id, reset_per_forward=True)
    gated_lora._install_adapter(model, pairs, 2.0, gate)
    return model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_static_cache_decodes_as_stock_greedy_and_the_dynamic_cache(arch):
    tokenizer = tiny_tokenizer()
    model = enable_mars(tiny_model(arch, tokenizer=tokenizer, block_size=3).eval())
    ids, attention = left_padded(mask=tokenizer.mask_token_id)
    common = dict(attention_mask=attention, max_new_tokens=17, do_sample=False)
    stock = model.generate(ids, **common)
    for mode in MODES:
        static = model.generate(ids, cache_implementation="static", **mode, **common)
        assert torch.equal(static, stock), mode
    for tau in (0.6, 0.2):  # τ < 1: what the dynamic cache gives, on the same fixed window
        dynamic = model.generate(ids, mars_threshold=tau, **common)
        static = model.generate(ids, mars_threshold=tau, cache_implementation="static", **common)
        assert torch.equal(static, dynamic), tau


def test_static_steps_have_one_shape_and_the_cache_never_grows():
    tokenizer = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tokenizer, block_size=2).eval())
    ids, attention = left_padded(mask=tokenizer.mask_token_id)
    cache = MARSStaticCache(model.config, 64, 3)
    out = model.generate(
        ids,
        attention_mask=attention,
        mars_acceptance="verify",
        mars_layout="linear",
        cache=cache,
        max_new_tokens=20,
        return_dict_in_generate=True,
        do_sample=False,
    )
    widths = out.forward_widths.tolist()
    settings = MARSDecodingSettings(
        window=2, mask_token_id=tokenizer.mask_token_id, acceptance="verify", layout="linear"
    )
    assert widths[0] >= ids.shape[1] and set(widths[1:]) == {widest_step(settings)} == {5}
    assert cache.num_allocations == len(cache.layers)  # allocated once per layer, at the prefill
    assert all(layer._key_buffer.shape[2] == 64 for layer in cache.layers)
    assert torch.equal(
        out.sequences, model.generate(ids, attention_mask=attention, max_new_tokens=20, do_sample=False)
    )


def test_where_columns_cost_the_static_planner_takes_plain_or_full_steps(trained, monkeypatch):
    """Where a compiled step's columns cost (float32/float64 on a CPU), verify's planner chooses each step between
    the two compiled shapes, one column or the full step, on the assumed curve read at those widths; where they
    are nearly free (an accelerator, native bf16) the fixed feed runs every step full. A given curve is read at
    the two widths. The tokens are stock greedy's whatever the feed."""
    from mars_hf.decoding import cost_model

    model, tokenizer, encoded = trained
    common = dict(max_new_tokens=16, do_sample=False, cache_implementation="static")
    common["return_dict_in_generate"] = True
    stock = model.generate(**encoded, max_new_tokens=16, do_sample=False)
    settings = MARSDecodingSettings(window=2, mask_token_id=tokenizer.mask_token_id, acceptance="verify")
    full = widest_step(settings)
    assumed = 1 + cost_model.ASSUMED_CPU_COLUMN_COST * (full - 1)

    out = model.generate(**encoded, mars_acceptance="verify", **common)  # float64: columns cost
    assert torch.equal(out.sequences, stock)
    assert set(out.forward_widths.tolist()[1:]) <= {1, full} and "fixed" not in out.plan_counts
    assert out.cost_curve == {1: 1.0, 2: assumed, full: assumed}
    cheap = model.generate(**encoded, mars_acceptance="verify", mars_cost_table={1: 1.0, 64: 1.0}, **common)
    assert torch.equal(cheap.sequences, stock)
    assert set(cheap.forward_widths.tolist()[1:]) in ({1, full}, {full})
    assert cheap.cost_curve == {1: 1.0, 2: 1.0, full: 1.0} and cheap.drafts_accepted.sum() > 0
    assert (cheap.forward_widths > 1).sum() > (out.forward_widths > 1).sum()  # columns said free: fed more

    monkeypatch.setattr(cost_model, "cpu_has_native_bf16", lambda: True)
    assert not cost_model.columns_nearly_free(model)  # float64 is not bf16
    assert cost_model.columns_nearly_free(tiny_model("llama", dtype=torch.bfloat16))
    monkeypatch.setattr(cost_model, "columns_nearly_free", lambda model: True)
    fixed = model.generate(**encoded, mars_acceptance="verify", **common)
    assert torch.equal(fixed.sequences, stock)
    assert set(fixed.forward_widths.tolist()[1:]) == {full} and set(fixed.plan_counts) == {"fixed"}


def test_a_static_cache_too_small_says_so():
    tokenizer = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tokenizer, block_size=2).eval())
    ids, _ = left_padded(batch=1, lengths=(9,))
    with pytest.raises(RuntimeError, match="MARSStaticCache holds 16 entries"):
        model.generate(
            ids, mars_acceptance="verify", cache=MARSStaticCache(model.config, 16, 1), max_new_tokens=20
        )


def test_static_cache_refuses_no_cache_decoding():
    tokenizer = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tokenizer, block_size=2).eval())
    ids, _ = left_padded(batch=1, lengths=(9,))
    with pytest.raises(ValueError, match="drop `cache_implementation='static'`"):
        model.generate(
            ids, mars_threshold=0.9, mars_cache="none", cache_implementation="static", max_new_tokens=4
        )


def test_static_capacity_rounds_up_or_takes_max_cache_len():
    assert static_capacity(10) == 256 and static_capacity(257) == 512
    assert static_capacity(100, max_cache_len=300) == 300
    assert static_capacity(400, max_cache_len=300) == 512  # too small a ceiling is not used


def test_gated_adapter_on_the_static_cache_keeps_the_base_model_greedy():
    tokenizer = tiny_tokenizer()
    base = tiny_model("llama", tokenizer=tokenizer, block_size=2).eval()
    ids, attention = left_padded(mask=tokenizer.mask_token_id)
    stock = base.generate(ids, attention_mask=attention, max_new_tokens=15, do_sample=False)
    model = enable_mars(
        gated(tiny_model("llama", tokenizer=tokenizer, block_size=2).eval(), tokenizer.mask_token_id)
    )
    for mode in MODES[:2]:
        out = model.generate(
            ids,
            attention_mask=attention,
            cache_implementation="static",
            max_new_tokens=15,
            do_sample=False,
            **mode,
        )
        assert torch.equal(out, stock), mode


def fresh_compile_pair():
    """The mask token, a tiny base model and the same model with a random mask-gated adapter, with Dynamo's
    compiled graphs and counters reset."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tokenizer = tiny_tokenizer()
    mask = tokenizer.mask_token_id
    base = tiny_model("llama", tokenizer=tokenizer, block_size=2).eval()
    return mask, base, enable_mars(gated(tiny_model("llama", tokenizer=tokenizer, block_size=2).eval(), mask))


@pytest.mark.slow
def test_compiled_static_decoding_equals_stock_and_compiles_once_per_width(monkeypatch):
    """τ = 1 and verify through the compiled forward (Inductor, as ``compile_config`` asks) on a gated model equal
    stock greedy; the traced gate keeps real positions bit-equal to the eager base; two calls with other prompt
    lengths add no graph (one per step width: 1 column for τ = 1 and the planner's plain steps, traced without the
    gated adapters since they feed no mask; the full step for verify)."""
    from torch._dynamo.utils import counters

    mask, base, model = fresh_compile_pair()
    config = CompileConfig(fullgraph=True)  # a graph break fails the test
    # the traced gate: real positions bit-equal to the base model, masks adapted
    ids = torch.tensor([[5, 9, 11, 7, mask, mask]])
    graphs = []

    def keep_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    traced = torch.compile(model.__call__, fullgraph=True, backend=keep_graph)(input_ids=ids).logits
    # siblings reading one input (q/k/v, gate/up) share one x Aᵀ: one linear per adapted layer, one per group
    adapted = [m for m in model.modules() if isinstance(m, AdaptedLinear)]
    groups = {id(m.__dict__["_mars_adapter"].group) for m in adapted}
    assert len(groups) < len(adapted)
    linears = [n for n in graphs[0].graph.nodes if n.target is torch._C._nn.linear]
    assert len(linears) == len(adapted) + len(groups) + 1  # + the LM head
    assert torch.equal(traced[:, :4], base(input_ids=ids).logits[:, :4])
    assert not torch.allclose(traced[:, 4:], base(input_ids=ids).logits[:, 4:])
    assert torch.equal(traced, model(input_ids=ids).logits)
    # a forward its caller knows feeds no mask (the decoder's plain compiled steps) traces as the base model does
    plain_ids = ids[:, :4]
    with gated_lora.masks_absent(gated_lora.mask_gate(model), True):
        plain = torch.compile(model.__call__, fullgraph=True, backend=keep_graph)(input_ids=plain_ids).logits
    assert gated_lora.mask_gate(model).traced_masks  # restored
    linears = [n for n in graphs[-1].graph.nodes if n.target is torch._C._nn.linear]
    assert len(graphs) == 2 and len(linears) == len(adapted) + 1
    assert torch.equal(plain, base(input_ids=plain_ids).logits)
    torch._dynamo.reset()
    counters.clear()
    for seed, lengths in enumerate([(9, 5, 7), (11, 4, 6)]):
        ids, attention = left_padded(seed=seed, lengths=lengths, mask=mask)
        stock = base.generate(ids, attention_mask=attention, max_new_tokens=12, do_sample=False)
        for mode in [*MODES[:2], dict(mars_acceptance="verify", mars_layout="linear")]:
            out = model.generate(
                ids,
                attention_mask=attention,
                cache_implementation="static",
                compile_config=config,
                max_new_tokens=12,
                do_sample=False,
                **mode,
            )
            assert torch.equal(out, stock), (lengths, mode)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@pytest.mark.slow
def test_weight_freezing_takes_effect_and_every_call_decodes_on_its_own_cache(monkeypatch):
    """``compile_config.options={"freezing": True}`` (our commands' CPU config) really freezes: Inductor's freezing
    compiler runs (Dynamo reads the switch when it traces, so the decoder turns it on around its compiled calls),
    and freezing makes the weights constants but never the static cache: calls with other prompts and batch sizes
    (new caches) still equal stock greedy and add no graph."""
    from torch._dynamo.utils import counters
    from torch._inductor import compile_fx

    frozen = []
    freezing_compiler = compile_fx.fw_compiler_freezing

    def spy(*args, **kwargs):
        # the weights Dynamo made attributes of the graph (not inputs): what freezing folds into constants
        frozen.append(sum(node.op == "get_attr" for node in kwargs["dynamo_model"].graph.nodes))
        return freezing_compiler(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "fw_compiler_freezing", spy)
    mask, base, model = fresh_compile_pair()
    config = CompileConfig(fullgraph=True, mode=None, options={"freezing": True})
    for seed, (batch, lengths) in enumerate([(3, (9, 5, 7)), (2, (11, 4)), (3, (6, 8, 3))]):
        ids, attention = left_padded(batch=batch, seed=seed, lengths=lengths, mask=mask)
        stock = base.generate(ids, attention_mask=attention, max_new_tokens=10, do_sample=False)
        for mode in MODES[:2]:
            out = model.generate(
                ids,
                attention_mask=attention,
                cache_implementation="static",
                compile_config=config,
                max_cache_len=64,
                max_new_tokens=10,
                do_sample=False,
                **mode,
            )
            assert torch.equal(out, stock), (lengths, mode)
        assert frozen and min(frozen) > 0, frozen
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one per step width, as unfrozen


# ------------------------------------------------------------------------------ everything that works elsewhere


@pytest.fixture(scope="module")
def trained():
    """A tiny float64 model trained briefly (its masks are often right, so drafts are really kept), with a
    left-padded batch of prompts that repeat themselves (prompt lookup finds drafts)."""
    from tests.test_generation import peaked_model
    from tests.test_prompt_lookup import REPEATING

    model = enable_mars(peaked_model("llama", window=2, steps=120).eval())
    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = "left"
    return model, tokenizer, tokenizer(REPEATING, return_tensors="pt", padding=True)


def test_sampling_prompt_lookup_and_a_draft_model_on_the_static_cache(trained):
    model, tokenizer, encoded = trained
    greedy = dict(max_new_tokens=14, do_sample=False, return_dict_in_generate=True)
    stock = model.generate(**encoded, max_new_tokens=14, do_sample=False)
    out = model.generate(
        **encoded,
        mars_acceptance="verify",
        prompt_lookup_num_tokens=4,
        cache_implementation="static",
        **greedy,
    )
    assert torch.equal(out.sequences, stock)
    # a plain step, or the token, 4 drafts and W masks
    assert set(out.forward_widths.tolist()[1:]) <= {1, 1 + 4 + 2}
    out = model.generate(
        **encoded,
        mars_acceptance="verify",
        mars_layout="linear",
        prompt_lookup_num_tokens=4,
        cache_implementation="static",
        **greedy,
    )
    assert torch.equal(out.sequences, stock) and out.drafts_accepted.sum() > 0
    assert set(out.forward_widths.tolist()[1:]) == {1 + 4 + 2}  # the fixed feed: one shape
    draft = tiny_model("qwen2", seed=3, block_size=None).eval()
    out = model.generate(
        **encoded, mars_acceptance="verify", assistant_model=draft, num_assistant_tokens=3,
        cache_implementation="static", **greedy,
    )  # fmt: skip
    assert torch.equal(out.sequences, stock)
    for mode in (
        dict(mars_acceptance="verify"),
        dict(mars_threshold=0.7),
    ):  # the keyed draws: the same tokens
        sampled = dict(max_new_tokens=14, do_sample=True, top_k=20, **mode)
        torch.manual_seed(5)
        dynamic = model.generate(**encoded, **sampled)
        torch.manual_seed(5)
        static = model.generate(**encoded, cache_implementation="static", **sampled)
        assert torch.equal(static, dynamic), mode


def test_stopping_criteria_and_streamers_on_the_static_cache(trained):
    """A stopping criterion checked token by token inside a step (here: a token of stock's answer; stop strings
    take the same path) and a streamer get on the static cache what they get on the dynamic one."""
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.ended = True

    class StopAt(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    model, tokenizer, encoded = trained
    first = {k: v[:1] for k, v in encoded.items()}
    free = model.generate(**first, max_new_tokens=20, do_sample=False)
    stop = StopAt(int(free[0, first["input_ids"].shape[1] + 6]))
    common = dict(max_new_tokens=20, do_sample=False)
    stock = model.generate(**first, stopping_criteria=StoppingCriteriaList([stop]), **common)
    assert stock.shape[1] < free.shape[1]  # it did stop early
    recorders = {}
    for path in ("dynamic", "static"):
        recorders[path] = Recorder()
        out = model.generate(
            **first, mars_acceptance="verify", streamer=recorders[path],
            stopping_criteria=StoppingCriteriaList([stop]),
            **(dict(cache_implementation="static") if path == "static" else {}), **common,
        )  # fmt: skip
        assert torch.equal(out, stock), path
    assert recorders["static"].ended
    chunks = {path: torch.cat([c.flatten() for c in r.chunks]) for path, r in recorders.items()}
    assert torch.equal(chunks["static"], chunks["dynamic"])


def test_the_static_cache_leaves_the_kernels_to_the_compiler():
    """``mars_cpu_kernels="packed"`` packs the eager path's linears; on the fast path the compiler picks the
    kernels (the packed linears are the eager path's; Inductor emits its own), so the linears stay stock there."""
    from mars_hf.decoding.cpu_kernels import last_kernels

    tokenizer = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tokenizer, block_size=2, dtype=torch.float32).eval())
    ids, attention = left_padded(mask=tokenizer.mask_token_id)
    common = dict(attention_mask=attention, max_new_tokens=8, do_sample=False, mars_acceptance="verify")
    model.generate(ids, mars_cpu_kernels="packed", **common)
    assert last_kernels(model) == "packed oneDNN"  # the eager path packs as asked
    model.generate(ids, mars_cpu_kernels="packed", cache_implementation="static", **common)
    assert last_kernels(model) == "stock"


@pytest.mark.parametrize("cache", [None, "static"])
def test_the_default_feed_reads_no_clock_and_keeps_nothing_between_calls(trained, monkeypatch, cache):
    """transformers' defaults (eager, dynamic cache) and the static cache alike: the feed is a function of the
    tokens. No timing of the machine (a clock that raises) and nothing kept across calls: a call decodes with the
    same steps whatever ran before it, and the kernel decisions stay empty for this model. (The measured planner
    runs only with a ``PlannerMemory`` the caller owns, ``mars_cost_probe``.)"""
    from mars_hf.decoding import cost_model, cpu_kernels, decoder

    class NoClock:
        def perf_counter(self):
            raise AssertionError("the default feed read the clock")

        monotonic = perf_counter

    for module in (decoder, cost_model, cpu_kernels):
        monkeypatch.setattr(module, "time", NoClock())
    monkeypatch.setattr(cpu_kernels, "_DECISIONS", weakref.WeakKeyDictionary())  # empty for this test
    model, tokenizer, encoded = trained
    common = dict(max_new_tokens=16, do_sample=False, cache_implementation=cache)
    common["return_dict_in_generate"] = True
    first = model.generate(**encoded, mars_acceptance="verify", **common)
    model.generate(
        **{k: v[:1] for k, v in encoded.items()}, mars_threshold=0.5, **common
    )  # other work between
    again = model.generate(**encoded, mars_acceptance="verify", **common)
    assert torch.equal(first.sequences, again.sequences)
    assert first.forward_widths.tolist() == again.forward_widths.tolist()
    assert len(cpu_kernels._DECISIONS) == 0
    if cache == "static":  # float64 on a CPU: the assumed curve read at the two compiled widths
        assert first.cost_curve[2] == 1 + cost_model.ASSUMED_CPU_COLUMN_COST * (max(first.cost_curve) - 1)
    else:  # the planner on the assumed curve, not a measured one
        assert first.cost_curve == CostTable.assumed_cpu().as_dict()
    # the measured planner, asked for, times the machine; the static cache's fixed steps refuse it by name
    with pytest.raises(AssertionError if cache is None else ValueError, match="clock|mars_cost_probe"):
        model.generate(**encoded, mars_acceptance="verify", mars_cost_probe=True, **common)
