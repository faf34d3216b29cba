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

import mars_hf
from mars_hf.decoding import cost_model, cpu_kernels
from mars_hf.decoding.cpu_kernels import PackedLinear, active, last_kernels, packed_linears, use_packed
from mars_hf.decoding.generation import enable_mars
from tests.test_gated_lora import decode_steps, shipped_gated
from tests.test_generation import _batch
from tests.tiny import ARCHITECTURES, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


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
    originals = [id(m) for m in _linears(model)]
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
    assert [id(m) for m in _linears(model)] == originals  # the stand-ins are gone, the originals back


@pytest.mark.parametrize("exact", [True, False])
def test_one_row_runs_packed_only_where_the_pack_rounds_like_the_stock_kernel(
    exact, monkeypatch, packed_rows
):
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
    monkeypatch.setattr(
        cpu_kernels, "_onednn_linear", lambda x, p, bias: torch.nn.functional.linear(x, linear.weight, bias)
    )
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
    assert "no native bfloat16" in cpu_kernels.unavailable_reason(model) and not use_packed(
        tiny_model("llama", dtype=torch.bfloat16, block_size=None), "auto"
    )


def test_a_nested_block_keeps_the_outer_packing_and_generate_routes_the_layers_once(tok, monkeypatch):
    model = enable_mars(tiny_model("llama", seed=1, dtype=torch.float32))
    installs, original = [], cpu_kernels._install

    def counting(linear, *rest):
        installs.append(linear)
        return original(linear, *rest)

    monkeypatch.setattr(cpu_kernels, "_install", counting)
    with packed_linears(model, "packed") as outer:
        with packed_linears(model, "packed") as inner:
            assert outer and inner and active(model) and len(installs) == len(_linears(model))
        assert active(model)  # the inner block's exit leaves the outer block's routing in place
    assert not active(model)
    installs.clear()
    out = model.generate(
        **_batch(tok), max_new_tokens=9, do_sample=False, mars_acceptance="verify", mars_cpu_kernels="packed",
        mars_cost_table={1: 1.0}, return_dict_in_generate=True,
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
    assert not any(
        isinstance(getattr(m._mars_adapter.base_forward, "__self__", None), PackedLinear) for m in adapted
    )


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_verify_with_packed_steps_equals_stock_greedy(arch, tok, packed_rows):
    """float32 random models, left-padded batch: the steps' wide forwards really run packed."""
    model = enable_mars(tiny_model(arch, seed=1, dtype=torch.float32))
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=14, do_sample=False)
    for layout in ("linear", "quadratic"):
        out = model.generate(
            **encoded, max_new_tokens=14, do_sample=False, mars_acceptance="verify", mars_layout=layout,
            mars_cpu_kernels="packed", mars_cost_table={1: 1.0},
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
    assert not use_packed(model, "stock")
    with pytest.raises(MemoryError, match="'stock'"):
        use_packed(model, "packed")


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


# ---------------------------------------------------------------------------------------------------------
# The private ops themselves, the fallback, the memory check, plain decoding and the default
# ---------------------------------------------------------------------------------------------------------


def _random_linear(dtype, in_features=48, out_features=40, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, dtype=dtype)


def _reference_dtypes():
    """float32 always; bfloat16 where oneDNN computes it natively (elsewhere "packed" refuses it, tested above)."""
    return [torch.float32] + ([torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_the_private_ops_still_compute_the_linear_map(rows):
    """``_reorder_linear_weight`` then ``_linear_pointwise`` must be ``F.linear`` up to rounding, with and without a
    bias: if a torch release changes what these private ops mean, this fails (and the fallback keeps decoding)."""
    for dtype in _reference_dtypes():
        linear = _random_linear(dtype)
        pack = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), cpu_kernels.PACK_ROWS_HINT)
        x = torch.randn(rows, linear.in_features, dtype=dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        with torch.no_grad():
            for bias in (linear.bias, None):
                got = cpu_kernels.packed_matmul(x, pack, bias)
                assert got.shape == (rows, linear.out_features) and got.dtype == dtype
                expected = torch.nn.functional.linear(x, linear.weight, bias)
                torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("shape", [(48, 40), (64, 7), (9, 33)])
def test_the_one_row_exactness_flag_agrees_with_a_direct_comparison(shape):
    """The flag (two fixed probe rows) must say what a direct comparison of many random rows says: whether the pack
    gives the stock kernel's bits on one row."""
    for dtype in _reference_dtypes():
        linear = _random_linear(dtype, *shape, seed=shape[0])
        pack, flag = cpu_kernels._pack(linear)
        torch.manual_seed(1)
        with torch.no_grad():
            direct = all(
                torch.equal(
                    torch.nn.functional.linear(row, linear.weight, linear.bias),
                    torch.ops.mkldnn._linear_pointwise(row, pack, linear.bias, "none", [], ""),
                )
                for row in torch.randn(8, 1, shape[0], dtype=dtype)
            )
        assert flag == direct, dtype


def test_an_error_while_packing_falls_back_to_stock_with_a_warning(monkeypatch, caplog):
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    ids = torch.tensor([[3, 9, 4, 7]])

    def broken(*args, **kwargs):
        raise RuntimeError("this op changed")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken)
    with torch.no_grad():
        expected = model(ids).logits
        with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
            with packed_linears(model, "packed") as packed:
                got = model(ids).logits
                assert not packed and not active(model)
    assert torch.equal(got, expected) and "this op changed" in caplog.text
    assert last_kernels(model).startswith("stock (packed oneDNN failed: RuntimeError: this op changed")
    assert not use_packed(model, "packed") and not use_packed(model, "auto")  # warned once; stock from now on


def test_an_error_while_running_falls_back_to_stock_for_the_whole_model(monkeypatch, caplog):
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    ids = torch.tensor([[3, 9, 4, 7]])
    calls = []

    def broken(x2, packed, bias):
        calls.append(1)
        raise RuntimeError("oneDNN refused")

    with torch.no_grad():
        expected = model(ids).logits
        with (
            caplog.at_level("WARNING", logger=cpu_kernels.__name__),
            packed_linears(model, "packed") as packed,
        ):
            assert packed
            monkeypatch.setattr(cpu_kernels, "packed_matmul", broken)
            first = model(ids).logits
            second = model(ids).logits
            assert not active(model)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert len(calls) == 1 and caplog.text.count("oneDNN refused") == 1  # one failure, one warning
    assert "failed" in last_kernels(model)


def test_a_hooked_linear_is_left_in_place_and_its_hook_runs():
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(type(module)))
    with torch.no_grad(), packed_linears(model, "packed"):
        model(torch.tensor([[3, 9, 4]]))
        assert type(model.lm_head) is torch.nn.Linear and isinstance(
            model.model.layers[0].mlp.up_proj, PackedLinear
        )
    assert seen == [torch.nn.Linear]


def _fake_cgroup(tmp_path, monkeypatch, version: int, limit: str, usage: int, inactive: int):
    """A control-group tree under ``tmp_path`` for this process, its memory limit in a parent folder."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup-of-self"
    if version == 2:
        proc.write_text("0::/jobs/mine\n")
        parent = tmp_path / "jobs"
        files = {
            "memory.max": limit,
            "memory.current": str(usage),
            "memory.stat": f"anon 1\ninactive_file {inactive}\n",
        }
    else:
        proc.write_text("5:cpu:/\n4:memory:/jobs/mine\n0::/\n")
        parent = tmp_path / "memory" / "jobs"
        files = {
            "memory.limit_in_bytes": limit,
            "memory.usage_in_bytes": str(usage),
            "memory.stat": f"cache 5\ntotal_inactive_file {inactive}\n",
        }
    (parent / "mine").mkdir(parents=True)
    for name, text in files.items():
        (parent / name).write_text(text)
    monkeypatch.setattr(cpu_kernels, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(cpu_kernels, "CGROUP_ROOT", tmp_path)


@pytest.mark.parametrize("version", [2, 1])
def test_the_memory_check_reads_the_cgroup_limit(version, tmp_path, monkeypatch):
    """A container's limit binds well below the machine's free memory: the room left is the limit minus what the
    group uses (less its reclaimable file cache)."""
    _fake_cgroup(tmp_path, monkeypatch, version, limit=str(10**9), usage=900 * 10**6, inactive=50 * 10**6)
    monkeypatch.setattr(cpu_kernels, "_available_physical_bytes", lambda: 64 * 10**9)
    assert cpu_kernels._free_memory_bytes() == 150 * 10**6
    unlimited = "max" if version == 2 else "9223372036854771712"
    _fake_cgroup(tmp_path / "other", monkeypatch, version, limit=unlimited, usage=10**9, inactive=0)
    assert cpu_kernels._free_memory_bytes() == 64 * 10**9


def test_packed_checks_the_memory_too_and_names_the_fix(tmp_path, monkeypatch):
    model = tiny_model("llama", dtype=torch.float32, block_size=None)
    copy = cpu_kernels._copy_bytes(model)
    _fake_cgroup(tmp_path, monkeypatch, 2, limit=str(10**9), usage=10**9 - copy // 2, inactive=0)
    with pytest.raises(MemoryError, match="mars_cpu_kernels='packed'.*Use 'stock'"):
        use_packed(model, "packed")
    with pytest.raises(MemoryError):
        with packed_linears(model, "packed"):
            pass
    assert not use_packed(model, "auto") and not active(model)


def test_plain_decoding_runs_packed_inside_the_block(tok, packed_rows):
    """No MARS: stock ``generate`` inside ``packed_linears`` runs a batch's steps packed (several rows) and gives
    stock greedy's tokens; one-row steps stay stock unless ``all_rows``, which packs them too."""
    model = tiny_model("llama", seed=1, dtype=torch.float32, block_size=None)
    encoded = _batch(tok)
    common = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    stock = model.generate(**encoded, **common)
    with mars_hf.packed_linears(model):  # the public name
        packed = model.generate(**encoded, **common)
    assert torch.equal(packed.sequences, stock.sequences) and min(packed_rows) > 1
    single = {key: value[:1] for key, value in encoded.items()}
    stock_one = model.generate(**single, **common)
    packed_rows.clear()
    with packed_linears(model):
        model.generate(**single, **common)
    assert packed_rows and 1 not in packed_rows  # the prompt runs packed; one-row steps on the stock kernel
    with packed_linears(model, all_rows=True):
        all_rows = model.generate(**single, **common)
    assert 1 in packed_rows
    for ours, theirs in zip(all_rows.scores, stock_one.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_tau_one_with_packed_kernels_equals_stock_greedy(tok, packed_rows):
    model = enable_mars(tiny_model("llama", seed=1, dtype=torch.float32))
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=10, do_sample=False)
    out = model.generate(
        **encoded, max_new_tokens=10, do_sample=False, mars_threshold=1.0, mars_cpu_kernels="packed"
    )
    assert torch.equal(out, stock) and packed_rows and last_kernels(model) == "packed oneDNN"


def test_generate_runs_stock_kernels_by_default(tok, monkeypatch):
    """The default is "stock": no measurement, no pack, no private op (mars_cpu_kernels="auto" is opt-in)."""
    model = enable_mars(tiny_model("llama", seed=1, dtype=torch.float32))
    asked = []
    monkeypatch.setattr(cpu_kernels, "_pack", lambda linear: asked.append(linear))
    monkeypatch.setattr(cpu_kernels, "_decide", lambda model: asked.append(model))
    model.generate(**_batch(tok), max_new_tokens=6, do_sample=False, mars_threshold=0.5)
    model.generate(**_batch(tok), max_new_tokens=6, do_sample=False, mars_acceptance="verify")
    assert not asked and last_kernels(model) == "stock"


@pytest.mark.parametrize("choice, ran", [("stock", "stock"), ("packed", "packed oneDNN"), (None, None)])
def test_the_generate_command_takes_cpu_kernels_and_says_which_ran(
    choice, ran, tmp_path, capsys, monkeypatch
):
    """``mars-hf generate --cpu-kernels``: our own command may pick the fast kernels (default auto) and prints
    which ran; the text is the same whichever did (float32 tiny model, greedy, τ = 1)."""
    from mars_hf.cli import main

    tokenizer = tiny_tokenizer()
    tiny_model("llama", tokenizer=tokenizer, vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    decided = []
    monkeypatch.setattr(cpu_kernels, "_decide", lambda model: decided.append(model) or False)
    argv = ["generate", "hello world", "two", "--model", str(tmp_path), "--tau", "1.0", "--dtype", "float32"]
    assert main(argv + ["--max-new-tokens", "6", "--cpu-kernels", "stock"]) == 0
    stock_text = capsys.readouterr().out
    assert main(argv + ["--max-new-tokens", "6"] + (["--cpu-kernels", choice] if choice else [])) == 0
    captured = capsys.readouterr()
    assert captured.out == stock_text
    expected = ran or "stock"  # the default, auto, asks the (forced) measurement
    # τ = 1 decodes one token per step: no mask group for the planner to size
    assert (
        f"linear layers: {expected} (--cpu-kernels {choice or 'auto'}); τ window: fixed (--tau-window)]"
        in captured.err
    )
    assert "[path: eager; float32;" in captured.err
    assert bool(decided) == (choice is None)
