"""Packed oneDNN linears for MARS steps on CPU (``mars_hf.decoding.cpu_kernels``).

The packed kernel computes the same linear map in float32 with another summation order, so the checks are:
one-row inputs keep the stock kernel's bits (its own, or the pack's where they are the same: bfloat16 on
oneDNN), several rows agree with the stock kernel to float32
rounding, the model is untouched outside a step, gated adapters keep their adapter, and greedy verify
with packed steps still equals stock greedy decoding. The "auto" choice is tested on forced measurements
(its timing is the machine's, never asserted).
"""

from __future__ import annotations

import math

import pytest
import torch

from mars_hf.decoding import cost_model, cpu_kernels
from mars_hf.decoding.cpu_kernels import active, packed_linears, use_packed
from mars_hf.decoding.generation import enable_mars
from tests.test_gated_lora import decode_steps, shipped_gated
from tests.test_generation import _batch
from tests.tiny import ARCHITECTURES, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.fixture
def packed_rows(monkeypatch):
    """The input row counts of every linear that ran on the packed kernel."""
    rows, original = [], cpu_kernels.packed_matmul

    def counting(x2, packed, bias):
        rows.append(x2.shape[0])
        return original(x2, packed, bias)

    monkeypatch.setattr(cpu_kernels, "packed_matmul", counting)
    return rows


def test_rows_run_packed_within_float32_rounding_and_one_row_stays_stock(packed_rows):
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    ids = torch.tensor([[3, 9, 4, 7, 5, 11]])
    with torch.no_grad():
        stock_many, stock_one = model(ids).logits, model(ids[:, :1]).logits
        with packed_linears(model, "packed") as packed:
            assert packed and active(model)
            many = model(ids).logits
            ran = len(packed_rows)
            one = model(ids[:, :1]).logits
        assert ran == len(_linears(model)) == len(packed_rows)  # every linear packed; none for one row
        after = model(ids).logits
    assert torch.equal(one, stock_one)  # one row: the stock kernel, bit for bit
    torch.testing.assert_close(many, stock_many, rtol=1e-4, atol=1e-5)
    assert torch.equal(after, stock_many) and not active(model)
    assert all("forward" not in m.__dict__ for m in _linears(model))


@pytest.mark.parametrize("exact", [True, False])
def test_one_row_runs_packed_only_where_the_pack_rounds_like_the_stock_kernel(exact, monkeypatch, packed_rows):
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    monkeypatch.setattr(cpu_kernels, "_rounds_like_stock", lambda linear, pack: exact)
    ids = torch.tensor([[3, 9, 4]])
    with torch.no_grad(), packed_linears(model, "packed"):
        model(ids[:, :1])
        one_row_calls = len(packed_rows)
        model(ids)
    assert one_row_calls == (len(_linears(model)) if exact else 0)
    assert len(packed_rows) == one_row_calls + len(_linears(model))
    cpu_kernels._PACKS.clear()


def test_the_rounding_check_compares_the_packs_bits_with_the_stock_kernels(monkeypatch):
    linear = torch.nn.Linear(24, 10, dtype=torch.float32)
    pack = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), cpu_kernels.PACK_ROWS_HINT)
    # a pack that computes exactly F.linear: same bits
    monkeypatch.setattr(cpu_kernels, "_onednn_linear", lambda x, p, bias: torch.nn.functional.linear(x, linear.weight, bias))
    assert cpu_kernels._rounds_like_stock(linear, pack)
    # one that is off by a rounding step on some output: not the same kernel
    monkeypatch.setattr(
        cpu_kernels, "_onednn_linear",
        lambda x, p, bias: torch.nn.functional.linear(x, linear.weight, bias).nextafter(torch.tensor(math.inf)),
    )  # fmt: skip
    assert not cpu_kernels._rounds_like_stock(linear, pack)


def test_bfloat16_linears_pack_and_every_one_row_output_keeps_the_stock_bits(packed_rows, monkeypatch):
    """bfloat16 runs on oneDNN either way: the pack only saves the per-call weight reorder. Where oneDNN has
    no native bfloat16 the packed mode refuses, naming it."""
    model = tiny_model("llama", dtype=torch.bfloat16, block_size=None)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        with pytest.raises(ValueError, match="no native bfloat16"):
            use_packed(model, "packed")
        return
    ids = torch.tensor([[3, 9, 4, 7, 5, 11]])
    with torch.no_grad():
        stock_many, stock_one = model(ids).logits, model(ids[:, :1]).logits
        with packed_linears(model, "packed"):
            one = model(ids[:, :1]).logits
            one_row_packed = 1 in packed_rows
            many = model(ids).logits
    exact = [cpu_kernels._pack(linear)[1] for linear in _linears(model)]
    assert one_row_packed == all(exact) and one_row_packed == any(exact)  # oneDNN: all or none
    assert torch.equal(one, stock_one)  # the pack's own bits where it ran, the stock kernel's otherwise
    torch.testing.assert_close(many, stock_many, rtol=2e-2, atol=2e-2)
    assert max(packed_rows) == ids.shape[1]
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert "no native bfloat16" in cpu_kernels.unavailable_reason(model) and not use_packed(tiny_model(
        "llama", dtype=torch.bfloat16, block_size=None), "auto")


def test_a_nested_block_keeps_the_outer_packing_and_generate_routes_the_layers_once(tok, monkeypatch):
    model = enable_mars(tiny_model("llama", seed=1, dtype=torch.float32))
    installs, original = [], cpu_kernels._install

    def counting(linear):
        installs.append(linear)
        return original(linear)

    monkeypatch.setattr(cpu_kernels, "_install", counting)
    with packed_linears(model, "packed") as outer:
        with packed_linears(model, "packed") as inner:
            assert outer and inner and active(model) and len(installs) == len(_linears(model))
        assert active(model)  # the inner block's exit leaves the outer block's routing in place
    assert not active(model)
    installs.clear()
    out = model.generate(
        **_batch(tok), max_new_tokens=9, do_sample=False, mars_acceptance="verify", mars_cpu_kernels="packed",
        mars_cost_probe=False, return_dict_in_generate=True,
    )  # fmt: skip
    assert out.num_forwards > 2 and len(installs) == len(_linears(model)) and not active(model)


def test_a_nested_block_keeps_an_outer_block_that_did_not_pack(monkeypatch):
    """An outer block that chose stock kernels is not decided again by the blocks inside it (a step inside a
    whole `generate` call): they run stock too, without asking."""
    model = tiny_model("llama", seed=1, dtype=torch.float32)
    asked = []
    original = cpu_kernels.use_packed
    monkeypatch.setattr(cpu_kernels, "use_packed", lambda *args: (asked.append(args[1:]), original(*args))[1])
    with packed_linears(model, "stock") as outer:
        with packed_linears(model, "packed") as inner:
            assert not outer and not inner and not active(model)
    assert asked == [("stock",)]
    with packed_linears(model, "packed") as alone:  # the outer block has closed: asked again
        assert alone and active(model)
    assert asked == [("stock",), ("packed",)] and not active(model)


def test_packs_follow_weight_updates():
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    ids = torch.tensor([[3, 9, 4, 7]])
    with torch.no_grad():
        with packed_linears(model, "packed"):
            before = model(ids).logits
        model.lm_head.weight.mul_(2.0)  # an optimizer step, in place
        expected = model(ids).logits
        with packed_linears(model, "packed"):
            after = model(ids).logits
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(after, before)


def test_gated_adapter_layers_keep_their_adapter(tok, tmp_path, packed_rows):
    """The base forward runs packed, the adapter's product is added as before: the unpacked result."""
    _, shipped, _, _ = shipped_gated(tmp_path, "llama", tok, dtype=torch.float32)
    reference, real = decode_steps(shipped, tok)
    with packed_linears(shipped, "packed"):
        got, _ = decode_steps(shipped, tok)
    for ours, stock in zip(got, reference):
        torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-5)
    assert len(packed_rows) >= len(_linears(shipped))
    adapted = [m for m in _linears(shipped) if "_mars_adapter" in m.__dict__]
    assert adapted and not active(shipped)
    assert not any(isinstance(m._mars_adapter.base_forward, cpu_kernels._PackedForward) for m in adapted)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_verify_with_packed_steps_equals_stock_greedy(arch, tok, packed_rows):
    """float32 random models, left-padded batch: the steps' wide forwards really run packed."""
    model = enable_mars(tiny_model(arch, seed=1, dtype=torch.float32))
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=14, do_sample=False)
    for layout in ("linear", "quadratic"):
        out = model.generate(
            **encoded, max_new_tokens=14, do_sample=False, mars_acceptance="verify", mars_layout=layout,
            mars_cpu_kernels="packed", mars_cost_probe=False,
        )  # fmt: skip
        assert torch.equal(out, stock), layout
    assert packed_rows and min(packed_rows) > 1 and not active(model)


def test_auto_packs_only_where_it_measures_faster_and_the_copy_fits(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    measured = {"times": (1.0, 0.5)}
    monkeypatch.setattr(cpu_kernels, "_time_linear_shapes", lambda linears: measured["times"])
    monkeypatch.setattr(cpu_kernels, "_free_memory_bytes", lambda: 10**12)
    assert use_packed(model, "auto")
    measured["times"] = (1.0, 0.95)
    assert use_packed(model, "auto")  # decided once per model and thread count
    cpu_kernels._DECISIONS.pop(model)
    assert not use_packed(model, "auto")
    cpu_kernels._DECISIONS.pop(model)
    measured["times"] = (1.0, 0.5)
    monkeypatch.setattr(cpu_kernels, "_free_memory_bytes", lambda: 1000)  # the copy would not fit
    assert not use_packed(model, "auto")
    assert not use_packed(model, "stock") and use_packed(model, "packed")


def test_auto_measurement_leaves_the_random_state_alone():
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    torch.manual_seed(0)
    use_packed(model, "auto")  # measures (once per model and thread count)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))


def test_packed_is_refused_where_it_cannot_run_and_auto_stays_stock():
    model = tiny_model("llama", block_size=None)  # float64
    with pytest.raises(ValueError, match="float64, not float32 or bfloat16.*'auto' or 'stock'"):
        use_packed(model, "packed")
    assert not use_packed(model, "auto")
    with pytest.raises(ValueError, match="mars_cpu_kernels"):
        use_packed(model, "fast")


def test_bad_keyword_is_refused_by_generate(tok):
    model = enable_mars(tiny_model("llama", seed=1, dtype=torch.float32))
    with pytest.raises(ValueError, match="mars_cpu_kernels"):
        model.generate(**_batch(tok), max_new_tokens=3, mars_acceptance="verify", mars_cpu_kernels="fast")


def test_a_cost_curve_is_measured_per_kernel_choice():
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    stock_key = cost_model._key(model, model.device, 1, (1, 2))
    with packed_linears(model, "packed"):
        packed_key = cost_model._key(model, model.device, 1, (1, 2))
    assert stock_key != packed_key and cost_model._key(model, model.device, 1, (1, 2)) == stock_key
