"""What the mask gate costs: a gated checkpoint's forward of n rows against the base model's.

Loads the embedded SmolLM2-135M-Instruct twice, once plain (the base) and once with a mask-gated LoRA
attached by the shipped loader (``mars_hf.decoding.gated_lora.attach_shipped_adapter``, what a checkpoint's
``custom_generate/`` runs): ``--checkpoint`` (a gated adapter folder, or ``embedded-mars``), or by default
a random-initialised gated LoRA r = 32 on all 210 linear layers (written to a temporary folder in the
checkpoint format; its numbers do not matter, only its cost). ``--variants`` can add ``hooks``: the same
adapter applied as before this change (a forward hook per adapted layer: index_select, two matmuls,
index_add), so one run gives the before/after; and ``gated-same``: the lean forward with the LoRA
arithmetic in the model's dtype (``lora_dtype=model dtype``) instead of the CPU default (float32 for a
bf16 model), to check that default.

For each dtype (float32, bfloat16) and n in 1, 2, 4, 8, 16: a cached forward of n new rows over a KV
cache of ``--context`` tokens, as a MARS step feeds it (one real token, then n - 1 masks; n = 1 is one
mask), plus a plain one-token step without masks (``plain``, where the adapter must cost nothing).
Every repeat times each variant once, in rotating order (interleaved), the cache cropped back after each
forward; the table shows medians and the ratio to the base model's median (target: ≤ 1.10 for n ≤ 16).
It also prints the CPU's relevant flags and torch's thread count. ``--cpu-kernels packed`` runs every
variant's linears on packed oneDNN weights, as MARS steps do where ``mars_cpu_kernels="auto"`` packs. ``--profile`` adds torch.profiler's
top operators of one n = 4 forward per variant (the "where the time goes" table for docs/gated_adapters.md);
``--kernel-time`` the median time spent inside the C kernel's calls in the ``gated`` forward, timed directly.

A script, not a test: run it on an otherwise idle machine.

    python examples/gated_forward_cost.py                              # random gated r32, fp32 + bf16
    python examples/gated_forward_cost.py --variants base,gated,gated-same,hooks --profile
    python examples/gated_forward_cost.py --repeats 1 --dtypes float32 --rows 1,4   # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mars_hf.decoding import gated_lora
from mars_hf.decoding.cpu_kernels import packed_linears
from mars_hf.models.embedded_model import embedded_model_dir, resolve_model_path

INTERESTING_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu_description() -> str:
    flags, name = set(), platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("?", "x86_64", ""):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    present = [flag for flag in INTERESTING_FLAGS if flag in flags]
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
    return (
        f"{name}; flags: {' '.join(present) or 'none of ' + ','.join(INTERESTING_FLAGS)}; "
        f"torch {torch.__version__} capability {capability}; {torch.get_num_threads()} threads; "
        f"{os.cpu_count()} logical CPUs"
    )


# ------------------------------------------------------------------------------------------ the adapter
def write_random_gated_adapter(base_dir: Path, folder: Path, rank: int, seed: int = 0) -> None:
    """A gated LoRA (all linear layers of the decoder) in the checkpoint format, with one new mask row."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    tensors, targets = {}, set()
    for name, module in model.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            path = f"base_model.model.model.{name}"
            targets.add(name.rsplit(".", 1)[-1])
            a = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, generator=generator) * 0.01
            tensors[f"{path}.lora_A.weight"], tensors[f"{path}.lora_B.weight"] = a, b
    vocab = model.get_input_embeddings().weight.shape[0]
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": gated_lora.MARS_PEFT_TYPE,  # a gated adapter's own peft_type: plain PEFT refuses it
        "gate_token_id": vocab,
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted(targets),
        "base_model_name_or_path": str(base_dir),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "mars_config.json").write_text(
        json.dumps({"adapter_gating": "mask", "block_size": 4, "mask_token_id": vocab})
    )
    rows = {
        "ids": torch.tensor([vocab]),
        "num_embeddings": torch.tensor(vocab + 1),
        "input_embeddings": model.get_input_embeddings().weight.mean(0, keepdim=True),
    }
    save_file(
        rows,
        str(folder / "mars_mask_token.safetensors"),
        metadata={"format": "pt", "mars_adapter_gating": "mask"},
    )


def attach_as_hooks(model, checkpoint: Path) -> None:
    """The adapter as it was applied before the lean forward: a hook per layer, index ops per forward."""
    pairs, scaling = gated_lora.read_adapter_weights(checkpoint)
    mask_id = json.loads((checkpoint / "mars_config.json").read_text())["mask_token_id"]
    state = {}

    def record(module, args):
        flat = args[0].reshape(-1)
        index = (flat == mask_id).nonzero().flatten()
        state["index"] = index if index.numel() else None

    model.get_input_embeddings().register_forward_pre_hook(record)
    modules = dict(model.named_modules())
    for path, pair in pairs.items():
        module = modules[path]
        a = pair["A"].to(module.weight.dtype)
        b = pair["B"].to(module.weight.dtype)

        def hook(module, args, output, a=a, b=b):
            index = state["index"]
            if index is None:
                return output
            x = args[0]
            rows = x.reshape(-1, x.shape[-1]).index_select(0, index)
            delta = (F.linear(F.linear(rows, a), b) * scaling).to(output.dtype)
            flat = output.reshape(-1, output.shape[-1])
            return flat.index_add(0, index, delta).view_as(output)

        module.register_forward_hook(hook)


def resize_like(model, checkpoint: Path) -> None:
    """Give the base the checkpoint's vocabulary, so both sides pay the same LM head."""
    from safetensors.torch import load_file

    rows_file = checkpoint / "mars_mask_token.safetensors"
    if rows_file.is_file():
        needed = int(load_file(rows_file)["num_embeddings"])
        if needed > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(needed, mean_resizing=False)


def load_variants(base_dir: Path, checkpoint: Path, dtype: torch.dtype, names: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    resize_like(plain, checkpoint)
    models = {}
    for name in names:
        if name == "base":
            models[name] = plain
        elif name in ("gated", "gated-same", "gated-torch"):
            model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
            lora_dtype = dtype if name == "gated-same" else None
            kernel = "c" if name == "gated" else "torch"
            # includes the load-time check of real positions against the base model
            assert gated_lora.attach_shipped_adapter(model, checkpoint, lora_dtype=lora_dtype, kernel=kernel)
            models[name] = model
        elif name == "hooks":
            model = copy.deepcopy(plain)
            attach_as_hooks(model, checkpoint)
            models[name] = model
        else:
            raise ValueError(f"unknown variant {name!r} (base, gated, gated-torch, gated-same, hooks)")
    return models


# ------------------------------------------------------------------------------------------ timing
@torch.no_grad()
def prefill(model, context_ids):
    return model(input_ids=context_ids, use_cache=True).cache


@torch.no_grad()
def timed_forward(model, cache, ids) -> float:
    start = time.perf_counter()
    model(input_ids=ids, cache=cache, use_cache=True)
    elapsed = time.perf_counter() - start
    cache.crop(-ids.shape[1])
    return elapsed


def step_ids(n: int, mask_id: int, plain: bool) -> torch.Tensor:
    if plain:
        return torch.tensor([[1234]])
    return torch.tensor([[mask_id] if n == 1 else [1234] + [mask_id] * (n - 1)])


class KernelClock:
    """Time spent inside the C kernel's calls (``gated_lora.mask_rows_group_delta``), per forward: measured
    directly, so it does not drown in the forward-to-forward noise of a shared VM as a difference would."""

    def __init__(self):
        self.seconds = 0.0
        gated_lora.mask_rows_group_delta = self._timed(gated_lora.mask_rows_group_delta)

    def _timed(self, function):
        def timed(*args):
            start = time.perf_counter()
            result = function(*args)
            self.seconds += time.perf_counter() - start
            return result

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def measure(models: dict, mask_id: int, rows: list[int], context: int, repeats: int, warmup: int, clock=None):
    """``({(case, variant): median seconds}, [cases in order])``; with ``clock`` (a :class:`KernelClock`), also
    ``(case, "kernel")``: the median time inside the kernel's calls in the ``gated`` variant's forward."""
    generator = torch.Generator().manual_seed(0)
    context_ids = torch.randint(100, 40000, (1, context), generator=generator)
    caches = {name: prefill(model, context_ids) for name, model in models.items()}
    cases = [("plain", 1)] + [(f"n={n}", n) for n in rows]
    times = {(case, name): [] for case, _ in cases for name in models}
    names = list(models)
    for repeat in range(warmup + repeats):
        for case, n in cases:
            ids = step_ids(n, mask_id, case == "plain")
            shift = (repeat + n) % len(names)
            for name in names[shift:] + names[:shift]:  # rotate the order: no variant always goes first
                if clock is not None:
                    clock.take()
                elapsed = timed_forward(models[name], caches[name], ids)
                if repeat >= warmup:
                    times[(case, name)].append(elapsed)
                    if clock is not None and name == "gated":
                        times.setdefault((case, "kernel"), []).append(clock.take())
    return {key: statistics.median(value) for key, value in times.items()}, [case for case, _ in cases]


def profile(models: dict, mask_id: int, context: int, n: int = 4, top: int = 12) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    context_ids = torch.randint(100, 40000, (1, context), generator=torch.Generator().manual_seed(0))
    for name, model in models.items():
        cache = prefill(model, context_ids)
        ids = step_ids(n, mask_id, plain=False)
        for _ in range(3):
            timed_forward(model, cache, ids)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                timed_forward(model, cache, ids)
        print(f"\n-- profile: {name}, n = {n}, 5 forwards --")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", default=None, help="gated adapter folder or 'embedded-mars' (default: random r32)"
    )
    parser.add_argument("--rank", type=int, default=32, help="rank of the random adapter")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--context", type=int, default=100, help="tokens in the KV cache")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--variants", default="base,gated", help="comma list of base, gated (C kernel), gated-torch, gated-same, hooks (before)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--kernel-time", action="store_true", help="also time the C kernel's calls inside the gated forward"
    )
    parser.add_argument(
        "--cpu-kernels", choices=("stock", "packed"), default="stock",
        help="linears of every variant on stock or packed oneDNN kernels (packed: what MARS steps run on a CPU "
        "where mars_cpu_kernels='auto' packs)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    if "base" not in names:
        names.insert(0, "base")
    base_dir = embedded_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint:
            checkpoint = Path(resolve_model_path(args.checkpoint))
        else:
            checkpoint = Path(tmp) / "random-gated"
            write_random_gated_adapter(base_dir, checkpoint, args.rank)
        mask_id = int(json.loads((checkpoint / "mars_config.json").read_text())["mask_token_id"])
        print(f"CPU: {cpu_description()}")
        print(
            f"base: {base_dir}\nadapter: {args.checkpoint or f'random gated LoRA r{args.rank}, all linear'}"
        )
        print(
            f"KV cache {args.context} tokens, batch 1, {args.repeats} interleaved repeats, medians, "
            f"{args.cpu_kernels} linear kernels\n"
        )
        rows = [int(n) for n in args.rows.split(",")]
        clock = KernelClock() if args.kernel_time and "gated" in names else None
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name.strip())
            models = load_variants(base_dir, checkpoint, dtype, names)
            with contextlib.ExitStack() as kernels:
                for model in models.values():
                    kernels.enter_context(packed_linears(model, args.cpu_kernels))
                medians, cases = measure(models, mask_id, rows, args.context, args.repeats, args.warmup, clock)
            header = f"{dtype_name:>9} {'rows':>6} " + " ".join(f"{name + ' ms':>10}" for name in names)
            header += " " + " ".join(f"{name + '/base':>12}" for name in names if name != "base")
            print(header + (f" {'kernel ms':>10} {'kernel/base':>12}" if clock else ""))
            for case in cases:
                base = medians[(case, "base")]
                line = f"{'':>9} {case:>6} " + " ".join(f"{1000 * medians[(case, n)]:>10.2f}" for n in names)
                line += " " + " ".join(f"{medians[(case, n)] / base:>12.3f}" for n in names if n != "base")
                if (case, "kernel") in medians:
                    kernel = medians[(case, "kernel")]
                    line += f" {1000 * kernel:>10.2f} {kernel / base:>12.3f}"
                print(line)
            print()
            if args.profile:
                profile(models, mask_id, args.context)
            del models


if __name__ == "__main__":
    main()
