"""The C kernel of the mask-gated delta (mars_hf/decoding/gated_kernel.py) against slow torch arithmetic."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from mars_hf.decoding import gated_kernel, gated_lora
from tests.test_gated_lora import decode_steps, shipped_gated


def runs_kernel(module) -> bool:
    """Whether an adapted layer's inference forwards run the C kernel (else the torch form)."""
    return module.__dict__["_mars_adapter"].group.kernel_dtype is not None


def unload_kernel(monkeypatch) -> None:
    """The module as a new process finds it: no library loaded, no failure recorded (restored after the test)."""
    for name, value in (("_LIBRARY", None), ("_FAILURE", None), ("_FUNCTIONS", {})):
        monkeypatch.setattr(gated_kernel, name, value)


@pytest.fixture(params=gated_kernel.VECTOR_BYTES)
def vector_bytes(request, monkeypatch) -> int:
    """Each of the kernel's vector widths, whatever this CPU's registers (a build per width, cached): the AVX-512
    width's code paths are tested on an AVX2 machine too, where GCC runs them slowly but exactly."""
    monkeypatch.setenv(gated_kernel.VECTOR_BYTES_ENV, request.param)
    unload_kernel(monkeypatch)
    assert gated_kernel.vector_bytes() == int(request.param), gated_kernel.failure()
    return int(request.param)


def group_delta(x, index, a, outputs, bts):
    """The kernel's one call for a sibling group: every member's delta at the mask rows, in place."""
    gated_kernel.mask_rows_group_delta(gated_kernel.GroupPlan(outputs[0].dtype, a, bts), x, index, outputs)


@pytest.mark.parametrize(
    "model_dtype, matrices, tolerance",
    [
        (torch.float64, torch.float64, 1e-12),
        (torch.float32, torch.float32, 1e-5),
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.bfloat16, torch.float32, 1e-2),
        (torch.bfloat16, torch.bfloat16, 1e-2),
    ],
)
# rank 3: nine rows of A, two blocks of four and one row alone
@pytest.mark.parametrize("rank", [3, 4, 12])
# 40 and 200 outputs: whole vectors and a partial one (the split over threads:
# test_a_group_split_over_threads_gives_the_one_thread_bits)
@pytest.mark.parametrize("outputs", [40, 200])
def test_kernel_writes_each_members_delta_at_mask_rows_only(model_dtype, matrices, tolerance, rank, outputs, vector_bytes):
    torch.manual_seed(0)
    # two sequences of five positions, flattened to ten rows; 27 inputs: whole vectors and a tail
    x = torch.randn(2, 5, 27, dtype=model_dtype)
    a = torch.randn(3 * rank, 27, dtype=matrices)  # three siblings' A, stacked
    bts = [torch.randn(rank, width, dtype=matrices) for width in (outputs, outputs + 3, 7)]
    ys = [torch.randn(2, 5, width, dtype=model_dtype) for width in (outputs, outputs + 3, 7)]
    before = [y.clone() for y in ys]
    index = torch.tensor([1, 4, 7, 8, 9])  # mask rows in both sequences: a block of four and one more
    group_delta(x, index, a, ys, bts)

    t = x.reshape(10, 27)[index].double() @ a.double().T  # float64, slowly
    real = [r for r in range(10) if r not in index.tolist()]
    for member, (y, old, bt) in enumerate(zip(ys, before, bts)):
        slow = t[:, member * rank : (member + 1) * rank] @ bt.double()
        flat, old = y.reshape(10, -1), old.reshape(10, -1)
        assert torch.equal(flat[real], old[real])  # never written: the base layer's bits
        torch.testing.assert_close(flat[index].double(), old[index].double() + slow, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "model_dtype, matrices, tolerance",
    [(torch.float64, torch.float64, 1e-12), (torch.float32, torch.float32, 1e-4), (torch.bfloat16, torch.bfloat16, 1e-1)],
)
def test_a_group_split_over_threads_gives_the_one_thread_bits(model_dtype, matrices, tolerance, vector_bytes):
    """A call of at least min_parallel_work() multiply-adds runs on torch's threads (the suite runs torch on one: two
    here); every sum keeps its order, so the mask rows get the one-thread result bit for bit, and the float64 one."""
    torch.manual_seed(3)
    n, inputs, rank, widths = 6, 1027, 64, (2048, 2051, 9)
    work = n * inputs * 3 * rank + n * rank * sum(widths)
    x = torch.randn(9, inputs, dtype=model_dtype)
    a = (torch.randn(3 * rank, inputs) / inputs**0.5).to(matrices)
    bts = [torch.randn(rank, width, dtype=matrices) for width in widths]
    index = torch.tensor([0, 1, 2, 3, 5, 8])  # a block of four, then two rows one at a time
    results, threads_used = {}, {}
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            threads_used[threads] = (gated_kernel.threads_for(work), gated_kernel.threads_for(gated_kernel.min_parallel_work() - 1))
            ys = [torch.zeros(9, width, dtype=model_dtype) for width in widths]
            group_delta(x, index, a, ys, bts)
            results[threads] = ys
    finally:
        torch.set_num_threads(previous)
    assert work >= gated_kernel.min_parallel_work() == gated_kernel.DEFAULT_MIN_PARALLEL_WORK
    assert threads_used == {1: (1, 1), 2: (2, 1)}  # this call split; one multiply-add less would not have
    t = x[index].double() @ a.double().T
    for member, (one, two, bt) in enumerate(zip(results[1], results[2], bts)):
        assert torch.equal(one, two)
        slow = t[:, member * rank : (member + 1) * rank] @ bt.double()
        torch.testing.assert_close(two[index].double(), slow, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mask_rows_delta_does_not_depend_on_the_rows_beside_it(dtype, vector_bytes):
    """The kernel takes mask rows four at a time and the rest one at a time: each row's sums keep one order either
    way, so a row gets the same bits alone as in a block (a mask's logits do not depend on how many masks a step
    feeds)."""
    torch.manual_seed(4)
    x, a, bt = torch.randn(5, 37, dtype=dtype), torch.randn(8, 37, dtype=dtype), torch.randn(8, 45, dtype=dtype)
    together = torch.zeros(5, 45, dtype=dtype)
    group_delta(x, torch.arange(5), a, [together], [bt])
    for row in range(5):
        alone = torch.zeros(5, 45, dtype=dtype)
        group_delta(x, torch.tensor([row]), a, [alone], [bt])
        assert torch.equal(alone[row], together[row])


@pytest.mark.parametrize("pairs", ["", "0"])
def test_bfloat16_pair_products_where_the_cpu_has_them_and_exact_sums(pairs, vector_bytes, monkeypatch):
    """A bf16 model's ``x Aᵀ`` sums pairs of bf16 products per instruction exactly where the CPU has AVX512_BF16
    (and MARS_HF_KERNEL_BF16_PAIRS=0 builds the widened path a CPU without it runs, so that both are tested here);
    either way whole vectors, odd tails and every block shape (a 4 x 4 block, the rows and the ranks left over) sum
    small integers exactly, so the kernel must give the float64 result bit for bit."""
    monkeypatch.setenv(gated_kernel.BF16_PAIRS_ENV, pairs)
    unload_kernel(monkeypatch)
    has_pairs = "avx512_bf16" in gated_kernel._cpu_flags().split()
    assert gated_kernel.bf16_pair_products() == (has_pairs and pairs != "0"), gated_kernel.failure()
    generator = torch.Generator().manual_seed(5)
    inputs = 2 * 64 + 7  # whole steps of 32 pairs with AVX-512 (16 with AVX2's width), then an odd tail
    x = torch.randint(-3, 4, (6, inputs), generator=generator).to(torch.bfloat16)
    a = torch.randint(-3, 4, (6, inputs), generator=generator).to(torch.bfloat16)  # 6 rows: a block of 4, 2 left
    bt = torch.eye(6, 40, dtype=torch.bfloat16)  # the delta is t itself: exact in float32, then rounded once
    y = torch.zeros(6, 40, dtype=torch.bfloat16)
    index = torch.tensor([0, 1, 2, 3, 5])  # a block of four mask rows, then one alone
    group_delta(x, index, a, [y], [bt])
    t = x[index].double() @ a.double().T
    expected = torch.zeros(6, 40, dtype=torch.float64)
    expected[index, :6] = t
    assert torch.equal(y, expected.to(torch.bfloat16))


def test_bfloat16_sum_is_rounded_once_to_nearest_even(vector_bytes):
    """Integer-valued products are exact in float32 whatever the order: the result must be torch's rounding
    of the float32 sum, bit for bit (ties included: 256 + 1 is a tie in bf16, 256 + 3 is not)."""
    x = torch.tensor([[1.0, 2.0], [3.0, 1.0]], dtype=torch.bfloat16)
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.bfloat16)  # t = x at the mask rows
    bt = torch.tensor([[1.0, 3.0, -1.0, 0.5], [0.0, 1.0, 2.0, -3.0]], dtype=torch.bfloat16)
    y = torch.tensor([[256.0, 256.0, 256.0, 258.0], [256.0, 2.0**20, -256.0, 0.0]], dtype=torch.bfloat16)
    index = torch.tensor([0, 1])
    expected = (y.float() + x.float() @ bt.float()).to(torch.bfloat16)
    group_delta(x, index, a, [y], [bt])
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


def test_bfloat16_rounding_of_whole_vectors_matches_the_scalar_rounding(vector_bytes):
    """Outputs that fill whole vectors take the vector path: the same rounding, ties and NaN included."""
    generator = torch.Generator().manual_seed(1)
    rows, out = 3, 64  # whole chunks of two vectors per row, with AVX2's vectors and AVX-512's
    x = torch.randint(1, 4, (rows, 2), generator=generator).to(torch.bfloat16)
    a = torch.eye(2, dtype=torch.bfloat16)
    bt = torch.randint(-3, 4, (2, out), generator=generator).to(torch.bfloat16)
    magnitudes = torch.tensor([256.0, 258.0, 512.0, 2.0**20, 1.0, 0.0])
    y = magnitudes[torch.randint(0, 6, (rows, out), generator=generator)]
    y = (y * torch.where(torch.rand(rows, out, generator=generator) < 0.5, -1.0, 1.0)).to(torch.bfloat16)
    y[1, 5] = float("nan")
    y[2, 20] = float("inf")
    expected = (y.float() + x.float() @ bt.float()).to(torch.bfloat16)
    index = torch.arange(rows)
    group_delta(x, index, a, [y], [bt])
    finite = ~expected.isnan()
    assert torch.equal(y[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert y[1, 5].isnan() and not y[finite].isnan().any()


def test_the_kernel_and_the_torch_form_agree_on_a_shipped_adapter(tokenizer, tmp_path):
    """Same checkpoint, both forms, float64: the logits at masks agree to round-off, real positions exactly."""
    _, with_kernel, _, _ = shipped_gated(tmp_path / "c", "llama", tokenizer, kernel="c")
    _, with_torch, _, _ = shipped_gated(tmp_path / "torch", "llama", tokenizer, kernel="torch")
    assert runs_kernel(with_kernel.model.layers[0].self_attn.q_proj)
    assert not runs_kernel(with_torch.model.layers[0].self_attn.q_proj)
    got, real = decode_steps(with_kernel, tokenizer)
    expected, _ = decode_steps(with_torch, tokenizer)
    assert torch.equal(got[1][real], expected[1][real])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("buffer", ["mars_lora_A", "mars_lora_BT"])
@pytest.mark.parametrize("how", ["assign", "register_buffer"])
def test_the_kernel_reads_the_matrices_the_layers_hold_now(buffer, how, tokenizer, tmp_path):
    """A group's kernel call keeps its A and Bᵀ pointers between forwards; once a layer holds a new matrix (assigned,
    or registered again) the next forward must read the new one, as the torch form does."""
    _, with_kernel, _, _ = shipped_gated(tmp_path / "c", "llama", tokenizer, kernel="c")
    _, with_torch, _, _ = shipped_gated(tmp_path / "torch", "llama", tokenizer, kernel="torch")
    before, real = decode_steps(with_kernel, tokenizer)  # the kernel's plans are built here
    for model in (with_kernel, with_torch):
        for module in model.modules():
            if buffer in module._buffers:
                new = module._buffers[buffer] * 3  # a new tensor in each layer
                if how == "assign":
                    setattr(module, buffer, new)
                else:
                    module.register_buffer(buffer, new, persistent=False)
                assert buffer in module._non_persistent_buffers_set  # still out of the state dict
    got, _ = decode_steps(with_kernel, tokenizer)
    expected, _ = decode_steps(with_torch, tokenizer)
    assert not torch.allclose(got[1][~real], before[1][~real])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("buffer", ["mars_lora_A", "mars_lora_BT"])
def test_the_kernel_reads_matrices_edited_in_place(buffer, tokenizer, tmp_path):
    """A group's plan keeps the addresses of A and each Bᵀ: an in-place edit of either (same tensor, same storage)
    must reach the next forward too, as it does the torch form's."""
    _, with_kernel, _, _ = shipped_gated(tmp_path / "c", "llama", tokenizer, kernel="c")
    _, with_torch, _, _ = shipped_gated(tmp_path / "torch", "llama", tokenizer, kernel="torch")
    before, real = decode_steps(with_kernel, tokenizer)  # the kernel's plans are built here
    for model in (with_kernel, with_torch):
        for module in model.modules():
            if buffer in module._buffers:
                module._buffers[buffer].mul_(3)
    got, _ = decode_steps(with_kernel, tokenizer)
    expected, _ = decode_steps(with_torch, tokenizer)
    assert not torch.allclose(got[1][~real], before[1][~real])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-12, atol=1e-12)


def test_matrices_moved_in_place_by_module_apply_are_read_where_they_now_are(tokenizer, tmp_path):
    """``model.share_memory()`` moves every buffer's storage without replacing the tensor (``nn.Module._apply``): a
    plan built before it holds the old addresses, so the adapted layers' ``_apply`` must drop it; the next forward
    reads the matrices where they are now (and gives the torch form's logits)."""
    _, with_kernel, _, _ = shipped_gated(tmp_path / "c", "llama", tokenizer, kernel="c")
    _, with_torch, _, _ = shipped_gated(tmp_path / "torch", "llama", tokenizer, kernel="torch")
    decode_steps(with_kernel, tokenizer)  # the kernel's plans are built here
    q_proj = with_kernel.model.layers[0].self_attn.q_proj
    before = q_proj.mars_lora_BT.data_ptr()
    with_kernel.share_memory()
    assert q_proj.mars_lora_BT.data_ptr() != before  # same tensor, new storage
    assert q_proj.__dict__["_mars_adapter"].group.plan is None
    got, _ = decode_steps(with_kernel, tokenizer)
    expected, _ = decode_steps(with_torch, tokenizer)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-12, atol=1e-12)


def test_a_deep_copy_reads_its_own_matrices(tokenizer, tmp_path):
    """``copy.deepcopy`` of a gated model whose plans exist (they hold a C struct of the original's addresses) must
    work, and the copy must read its own matrices: an in-place edit of the original's does not reach it."""
    _, with_kernel, _, _ = shipped_gated(tmp_path / "c", "llama", tokenizer, kernel="c")
    before, real = decode_steps(with_kernel, tokenizer)  # the kernel's plans are built here
    copied = copy.deepcopy(with_kernel)
    for module in with_kernel.modules():
        for buffer in ("mars_lora_A", "mars_lora_BT"):
            if buffer in module._buffers:
                module._buffers[buffer].mul_(3)
    got, _ = decode_steps(copied, tokenizer)
    edited, _ = decode_steps(with_kernel, tokenizer)
    assert not torch.allclose(edited[1][~real], before[1][~real])
    for step in range(3):  # to round-off: a copy's weights sit elsewhere, which may change BLAS's summation order
        torch.testing.assert_close(got[step], before[step], rtol=1e-12, atol=1e-12)


def test_a_gated_model_round_trips_through_torch_save(tokenizer, tmp_path):
    """``torch.save`` of a whole gated model whose plans exist, then ``torch.load``: the wrapped forwards come back
    wrapping the layers' own forwards (not themselves), the plans come back empty, and the loaded model decodes as
    the saved one did."""
    _, with_kernel, _, _ = shipped_gated(tmp_path / "c", "llama", tokenizer, kernel="c")
    before, _ = decode_steps(with_kernel, tokenizer)  # the kernel's plans are built here
    torch.save(with_kernel, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded.model.layers[0].self_attn.q_proj.__dict__["_mars_adapter"].group.plan is None
    got, _ = decode_steps(loaded, tokenizer)
    for step in range(3):
        torch.testing.assert_close(got[step], before[step], rtol=1e-12, atol=1e-12)
    assert runs_kernel(loaded.model.layers[0].self_attn.q_proj)


def test_autograd_forwards_use_the_torch_form(tokenizer, tmp_path):
    """The kernel has no backward: with grad enabled the torch form runs, so the gradient through the
    adapter's delta reaches the input (it would be missing had the kernel written y behind autograd's back)."""

    def input_gradient(model):
        seen = []

        def keep(module, args, out):
            out.retain_grad()
            seen.append(out)

        hook = model.get_input_embeddings().register_forward_hook(keep)
        logits = model(input_ids=torch.tensor([[5, 6, tokenizer.mask_token_id]])).logits
        hook.remove()
        logits[0, -1].square().sum().backward()
        return seen[0].grad

    _, with_kernel, _, _ = shipped_gated(tmp_path / "c", "llama", tokenizer, kernel="c")
    _, with_torch, _, _ = shipped_gated(tmp_path / "torch", "llama", tokenizer, kernel="torch")
    torch.testing.assert_close(input_gradient(with_kernel), input_gradient(with_torch), rtol=1e-10, atol=1e-12)


def test_mode_is_read_from_the_environment_and_checked(monkeypatch):
    monkeypatch.setenv(gated_kernel.KERNEL_ENV, "torch")
    assert gated_kernel.kernel_mode() == "torch"
    assert gated_kernel.kernel_mode("c") == "c"  # an explicit argument wins
    monkeypatch.setenv(gated_kernel.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="MARS_HF_GATED_KERNEL"):
        gated_kernel.kernel_mode()


def test_a_kernel_that_cannot_build_is_an_error_in_c_mode_and_a_warning_in_auto(
    monkeypatch, tokenizer, tmp_path, caplog
):
    unload_kernel(monkeypatch)
    monkeypatch.setattr(gated_kernel, "_WARNED", False)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path / "home"))  # no cached build to fall back on
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-compiler-here'"):
        shipped_gated(tmp_path / "c", "llama", tokenizer, kernel="c")
    with caplog.at_level(logging.WARNING, logger=gated_kernel.__name__):
        base, shipped, _, _ = shipped_gated(
            tmp_path / "auto", "llama", tokenizer, dtype=torch.bfloat16, kernel="auto"
        )
    assert "torch form" in caplog.text and "no-such-compiler-here" in caplog.text
    assert not runs_kernel(shipped.model.layers[0].self_attn.q_proj)  # the torch form, working
    got, real = decode_steps(shipped, tokenizer)
    expected, _ = decode_steps(base, tokenizer)
    assert torch.equal(got[1][real], expected[1][real])


@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, True), (torch.float32, True), (torch.float64, False)])
def test_auto_runs_the_kernel_for_bfloat16_and_float32_models(dtype, kernel, tokenizer, tmp_path, monkeypatch):
    """``auto`` (opt-in): the kernel for the dtypes it was measured faster in (bf16, float32); BLAS's form for
    float64."""
    monkeypatch.delenv(gated_kernel.KERNEL_ENV, raising=False)
    _, shipped, _, _ = shipped_gated(tmp_path, "llama", tokenizer, dtype=dtype, kernel="auto")
    assert runs_kernel(shipped.model.layers[0].self_attn.q_proj) == kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_default_is_the_torch_form_and_builds_nothing(dtype, tokenizer, tmp_path, monkeypatch):
    """No mode given: the torch form, without a compiler run or a library loaded (the kernel is opt-in)."""
    monkeypatch.delenv(gated_kernel.KERNEL_ENV, raising=False)
    unload_kernel(monkeypatch)
    monkeypatch.setattr(gated_kernel, "_build", lambda: pytest.fail("the default path built the C kernel"))
    assert gated_kernel.kernel_mode() == "torch"
    _, shipped, _, _ = shipped_gated(tmp_path, "llama", tokenizer, dtype=dtype, kernel=None)
    assert not runs_kernel(shipped.model.layers[0].self_attn.q_proj)
    decode_steps(shipped, tokenizer)
    assert gated_kernel._LIBRARY is None


def test_the_build_is_cached_per_cpu_and_source(monkeypatch, tmp_path):
    """A second process (here: a reset module) loads the cached build instead of compiling again; another
    CPU's flags name another file."""
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    for _ in range(2):
        unload_kernel(monkeypatch)
        assert gated_kernel.library() is not None, gated_kernel.failure()
    builds = sorted((tmp_path / "kernels").glob("mars_gated_*.so"))
    assert len(builds) == 1
    monkeypatch.setattr(gated_kernel, "_cpu_flags", lambda: "some other cpu")
    unload_kernel(monkeypatch)
    assert gated_kernel.library() is not None
    assert len(sorted((tmp_path / "kernels").glob("mars_gated_*.so"))) == 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_verified_decoding_through_the_kernel_is_the_base_models_greedy_output(
    arch, tokenizer, tmp_path, monkeypatch, vector_bytes
):
    """float64 tiny models, batched with padding: verify and τ = 1 decode exactly like the base model, and
    the mask rows really went through the kernel."""
    from mars_hf.decoding.generation import enable_mars

    base, shipped, _, _ = shipped_gated(tmp_path, arch, tokenizer, kernel="c")
    calls = []
    original = gated_lora.mask_rows_group_delta
    monkeypatch.setattr(gated_lora, "mask_rows_group_delta", lambda *a: (calls.append(1), original(*a))[1])
    shipped = enable_mars(shipped)
    inputs = tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)
    common = dict(max_new_tokens=12, do_sample=False)
    # the loader suppresses the mask token as an output: so does the base model's greedy run here
    expected = base.generate(**inputs, suppress_tokens=[tokenizer.mask_token_id], **common)
    verified = shipped.generate(**inputs, mars_acceptance="verify", mars_layout="linear", **common)  # masks fed
    assert torch.equal(verified, expected)
    assert torch.equal(shipped.generate(**inputs, mars_threshold=1.0, **common), expected)
    assert calls  # the masks' delta came from the C kernel


def test_a_forced_vector_width_is_checked_and_builds_its_own_file(monkeypatch, tmp_path):
    """Unset: the CPU's width; forced: that width, in a build of its own (flags are in the cache key); anything
    else: an error naming the variable, not a silent default."""
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    widths = {}
    for forced in ("", "64", "48"):
        monkeypatch.setenv(gated_kernel.VECTOR_BYTES_ENV, forced)
        unload_kernel(monkeypatch)
        if forced == "48":
            with pytest.raises(ValueError, match="MARS_HF_KERNEL_VECTOR_BYTES must be one of 32, 64"):
                gated_kernel.library()
        else:
            widths[forced] = gated_kernel.vector_bytes()
    avx512 = "avx512f" in gated_kernel._cpu_flags().split()
    assert widths == {"": 64 if avx512 else 32, "64": 64}
    assert len(sorted((tmp_path / "kernels").glob("mars_gated_*.so"))) == 2


def test_a_bf16_pairs_setting_other_than_0_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(gated_kernel.BF16_PAIRS_ENV, "yes")
    unload_kernel(monkeypatch)
    with pytest.raises(ValueError, match="MARS_HF_KERNEL_BF16_PAIRS must be 0"):
        gated_kernel.library()


def test_a_forced_thread_threshold_is_checked_and_builds_its_own_file(monkeypatch, tmp_path):
    """MARS_HF_KERNEL_MIN_PARALLEL_WORK sets where a call splits over threads, in a build of its own; anything but
    a whole number is an error naming the variable."""
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    monkeypatch.setenv(gated_kernel.MIN_PARALLEL_WORK_ENV, "1000")
    unload_kernel(monkeypatch)
    assert gated_kernel.min_parallel_work() == 1000
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert (gated_kernel.threads_for(999), gated_kernel.threads_for(1000)) == (1, 2)
    finally:
        torch.set_num_threads(previous)
    monkeypatch.setenv(gated_kernel.MIN_PARALLEL_WORK_ENV, "2^14")
    unload_kernel(monkeypatch)
    with pytest.raises(ValueError, match="MARS_HF_KERNEL_MIN_PARALLEL_WORK must be a whole number"):
        gated_kernel.library()
    monkeypatch.delenv(gated_kernel.MIN_PARALLEL_WORK_ENV)
    unload_kernel(monkeypatch)
    assert gated_kernel.min_parallel_work() == gated_kernel.DEFAULT_MIN_PARALLEL_WORK
    assert len(sorted((tmp_path / "kernels").glob("mars_gated_*.so"))) == 2


def test_a_compiler_without_openmp_builds_it_single_threaded(monkeypatch, tmp_path):
    """The OpenMP build fails (here: an unknown flag): the plain build serves, with the same results."""
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    unload_kernel(monkeypatch)
    monkeypatch.setattr(gated_kernel, "OPENMP_FLAG", "-fno-such-openmp-flag")
    assert gated_kernel.library() is not None, gated_kernel.failure()
    torch.manual_seed(1)
    x, a, bt = torch.randn(3, 20), torch.randn(8, 20), torch.randn(8, 33)
    y, index = torch.zeros(3, 33), torch.tensor([0, 2])
    group_delta(x, index, a, [y], [bt])
    slow = x[index].double() @ a.double().T @ bt.double()
    torch.testing.assert_close(y[index].double(), slow, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[1], torch.zeros(33))


def _cached_libraries(home):
    return sorted((home / "kernels").glob("mars_gated_*.so"))


def _replace_bytes(path, data: bytes) -> None:
    """Put ``data`` at ``path`` as a new file: this process has the old one mapped (damaging that inode in place
    would fault here, the very fault the tests are about), the next process finds the new one."""
    spare = path.with_name(path.name + ".damaged")
    spare.write_bytes(data)
    spare.replace(path)


@pytest.mark.parametrize("compiler", ["gcc -std=gnu99", "env gcc", "'gcc'"])
def test_a_compiler_setting_of_several_words_is_run_as_a_command_line(compiler, monkeypatch, tmp_path):
    """``CC="gcc -std=gnu99"`` or ``CC="ccache gcc"`` (here ``env gcc``, a wrapper found on any system) name a
    compiler with arguments or behind a launcher, as make and setuptools read them; they were "no C compiler"."""
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    unload_kernel(monkeypatch)
    assert gated_kernel.library() is not None, gated_kernel.failure()
    monkeypatch.setenv("CC", "gcc 'unbalanced")
    unload_kernel(monkeypatch)
    assert gated_kernel.library() is None and "not a command line" in gated_kernel.failure()


@pytest.mark.parametrize("damage", [b"", b"not a library at all"])
def test_an_empty_or_garbage_cached_build_is_rebuilt(damage, monkeypatch, tmp_path):
    """A cached library that is not what was built is replaced by a fresh build (it used to be loaded, fail, and
    leave the torch form with a warning to install a compiler, in every process, for good)."""
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    unload_kernel(monkeypatch)
    assert gated_kernel.library() is not None, gated_kernel.failure()
    (built,) = _cached_libraries(tmp_path)
    _replace_bytes(built, damage)
    unload_kernel(monkeypatch)
    assert gated_kernel.library() is not None, gated_kernel.failure()
    assert gated_kernel.vector_bytes() in (32, 64)
    assert all(path.stat().st_size > 1000 for path in _cached_libraries(tmp_path))


def test_a_truncated_cached_build_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A library cut short in place (a full disk, an interrupted copy of the cache) made the loader's mapping fault:
    every later process died of SIGBUS (exit 135) with no message. Checked against its record first, it is rebuilt.
    A fresh process loads it here, so a fault fails this test instead of killing the test run."""
    import subprocess
    import sys

    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    unload_kernel(monkeypatch)
    assert gated_kernel.library() is not None, gated_kernel.failure()
    for built in _cached_libraries(tmp_path):
        _replace_bytes(built, built.read_bytes()[: built.stat().st_size * 2 // 3])
    script = "from mars_hf.decoding import gated_kernel as k; print(k.vector_bytes(), k.failure())"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.split()[0] in ("32", "64"), result.stdout
    assert "building it again" in result.stderr


def test_a_failed_build_in_auto_mode_warns_with_its_reason_not_a_compiler_hint(monkeypatch, tmp_path, caplog):
    """The warning names what failed (here: the compiler rejects a flag), not "install a C compiler"."""
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "gcc -fno-such-flag-at-all")
    unload_kernel(monkeypatch)
    monkeypatch.setattr(gated_kernel, "_WARNED", False)
    with caplog.at_level(logging.WARNING, logger=gated_kernel.__name__):
        assert not gated_kernel.use_kernel("auto", torch.device("cpu"), torch.float32)
    assert "failed to build" in caplog.text and "no-such-flag" in caplog.text
    assert "install" not in caplog.text.lower()
    with pytest.raises(RuntimeError, match="failed to build"):
        gated_kernel.use_kernel("c", torch.device("cpu"), torch.float32)
