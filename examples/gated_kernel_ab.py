"""Builds of the mask-gated adapter side by side, in whole forwards: does a change pay where it runs?

Timing the kernel's calls on their own misleads: between two calls of a real forward torch runs its own parallel
products, attention and norms, which decide how warm the caches and the OpenMP threads are. (Timed between bare base
products, one thread looked faster for every SmolLM2 group; in whole forwards it was no faster.) So this script times
whole cached forwards of n rows as a MARS step feeds them (one real token, then masks) for the base model and each
build, interleaved, the cache cropped back after each, and prints each build's gated forward ÷ the base model's,
medians over ``--repeats``.

Ways to compare:
- the C kernel alone (default): one gated model serves every build, each build's kernel plans swapped in before its
  forwards, so no build gains or loses from where its copy of the weights landed in memory (with one copy per
  build that moved ratios by up to 0.04 here). Builds: ``worktree`` (this checkout's
  ``mars_hf/decoding/gated_kernel.py``), ``REV`` (that file at a git revision, e.g. ``c34c627``), ``worktree@N``
  (this checkout's source with ``MARS_HF_KERNEL_MIN_PARALLEL_WORK=N``: where a call starts to split over threads).
  Each build compiles into ``$MARS_HF_HOME/kernels`` under its own name.
- ``--base same-copy`` (kernel builds): divide by the gated model's own forward of as many real tokens (no mask,
  so the adapter is skipped: the base model's arithmetic) instead of a separate base copy's, so that neither copy's
  place in memory is in the ratio. ``--builds worktree --base same-copy`` is what the gate costs this checkout.
- ``--whole-adapter``: the adapter's Python too (``gated_lora``, ``gated_kernel`` and ``home`` of a revision, loaded
  as a package of their own; ``worktree`` is this checkout's). One gated copy per build, loaded in ``--builds``
  order: run it twice with the order swapped, since a copy's place in memory moves its ratio.

A script, not a test: run it on an otherwise idle machine.

    python examples/gated_kernel_ab.py --builds c34c627,worktree --dtypes bfloat16 --cpu-kernels packed
    python examples/gated_kernel_ab.py --builds worktree,worktree@2097152 --rows 1,4,16 --repeats 31
    python examples/gated_kernel_ab.py --whole-adapter --builds c34c627,worktree --repeats 21
    python examples/gated_kernel_ab.py --builds worktree --base same-copy --dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from gated_forward_cost import cpu_description, load_variants, prefill, step_ids, timed_forward
from transformers import AutoModelForCausalLM

from mars_hf.decoding import gated_kernel, gated_lora
from mars_hf.decoding.cpu_kernels import packed_linears
from mars_hf.models.embedded_model import embedded_model_dir, resolve_model_path

KERNEL_PATH = "mars_hf/decoding/gated_kernel.py"
# The adapter's modules: they import only each other, torch, transformers, safetensors and the standard library.
ADAPTER_MODULES = ("gated_lora", "gated_kernel", "home")
PLAIN_TOKEN = 1234  # a real token: what --base same-copy feeds instead of the step's tokens


def revision_source(revision: str, path: str) -> str:
    return subprocess.run(
        ["git", "show", f"{revision}:{path}"], capture_output=True, text=True, check=True
    ).stdout


def load_build(name: str, scratch: Path):
    """The kernel module of build ``name`` (see the module docstring), its library built."""
    if name == "worktree":
        return gated_kernel
    base, _, threshold = name.partition("@")
    if base == "worktree":
        source = Path(gated_kernel.__file__).read_text()
    else:
        source = revision_source(base, KERNEL_PATH)
    source = source.replace("from .home import", "from mars_hf.decoding.home import")
    path = scratch / f"kernel_{len(list(scratch.iterdir()))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    previous = os.environ.get(gated_kernel.MIN_PARALLEL_WORK_ENV)
    if threshold:
        os.environ[gated_kernel.MIN_PARALLEL_WORK_ENV] = threshold
    try:
        if module.library() is None:
            raise RuntimeError(f"build {name} failed: {module.failure()}")
    finally:
        os.environ.pop(gated_kernel.MIN_PARALLEL_WORK_ENV, None)
        if previous is not None:
            os.environ[gated_kernel.MIN_PARALLEL_WORK_ENV] = previous
    return module


def kernel_functions(module) -> tuple:
    """``(GroupPlan, mask_rows_group_delta)`` as ``gated_lora`` calls them, for this checkout's kernel interface and
    the one before it (commit c34c627 and earlier: ``GroupPlan(dtype, bts)``, the stacked A passed per call)."""
    if "a" in inspect.signature(module.GroupPlan).parameters:
        return module.GroupPlan, module.mask_rows_group_delta

    class Plan:
        def __init__(self, dtype, a, bts):
            self.a, self.inner = a, module.GroupPlan(dtype, bts)

        def matches(self, a, bts):
            return a is self.a and self.inner.matches(bts)

    def delta(plan, x, index, outputs):
        module.mask_rows_group_delta(plan.inner, x, index, plan.a, outputs)

    return Plan, delta


def kernel_groups(model) -> list:
    """The gated model's sibling groups (each holds its kernel plan)."""
    groups = []
    for module in model.modules():
        adapter = module.__dict__.get("_mars_adapter")
        if adapter is not None and adapter.group.leader is module:
            groups.append(adapter.group)
    return groups


def load_adapter_package(revision: str, scratch: Path):
    """``gated_lora`` as ``revision`` has it (with its own ``gated_kernel`` and ``home``), as a package of its own."""
    if revision == "worktree":
        return gated_lora
    name = f"adapter_{revision.replace('-', '_').replace('~', '_').replace('^', '_')}"
    (scratch / name).mkdir()
    (scratch / name / "__init__.py").write_text("")
    for module in ADAPTER_MODULES:
        source = revision_source(revision, f"mars_hf/decoding/{module}.py")
        (scratch / name / f"{module}.py").write_text(source)
    if str(scratch) not in sys.path:
        sys.path.insert(0, str(scratch))
    return importlib.import_module(f"{name}.gated_lora")


@torch.no_grad()
def interleaved_ratios(forwards: dict, rows: list[int], mask_id: int, repeats: int) -> None:
    """``forwards``: name -> function(ids) timing one cached forward of ``ids`` (``base`` first). Prints each
    other name's median ÷ the base's, per row count."""
    names = list(forwards)
    for n in rows:
        ids = step_ids(n, mask_id, plain=False)
        times = {name: [] for name in names}
        for repeat in range(repeats + 2):  # two warm-up rounds
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                elapsed = forwards[name](ids)
                if repeat >= 2:
                    times[name].append(elapsed)
        base = statistics.median(times["base"])
        ratios = "  ".join(f"{name} {statistics.median(times[name]) / base:.3f}" for name in names[1:])
        print(f"  n={n:>2}: base {1000 * base:6.2f} ms   gated / base: {ratios}")


def compare_kernels(base, gated, kernels: dict, mask_id: int, rows: list[int], repeats: int) -> None:
    """One gated model serves every kernel build: each build's plans are swapped in before its forwards. ``base``
    None: the base forward is the gated model's own on as many real tokens (no mask: the adapter is skipped)."""
    context = torch.randint(100, 40000, (1, 100), generator=torch.Generator().manual_seed(0))
    groups = kernel_groups(gated)
    plans = {name: [None] * len(groups) for name in kernels}  # the load-time check built this checkout's
    caches = {"gated": prefill(gated, context)}
    if base is None:
        forwards = {"base": lambda ids: timed_forward(gated, caches["gated"], torch.full_like(ids, PLAIN_TOKEN))}
    else:
        caches["base"] = prefill(base, context)
        forwards = {"base": lambda ids: timed_forward(base, caches["base"], ids)}

    def gated_forward(name):
        def forward(ids):
            gated_lora.GroupPlan, gated_lora.mask_rows_group_delta = kernels[name]
            for group, plan in zip(groups, plans[name]):
                group.plan = plan
            elapsed = timed_forward(gated, caches["gated"], ids)
            plans[name] = [group.plan for group in groups]
            return elapsed

        return forward

    forwards.update({name: gated_forward(name) for name in kernels})
    interleaved_ratios(forwards, rows, mask_id, repeats)


def compare_adapters(models: dict, mask_id: int, rows: list[int], repeats: int) -> None:
    """``models``: ``base`` and one gated copy per build."""
    context = torch.randint(100, 40000, (1, 100), generator=torch.Generator().manual_seed(0))
    caches = {name: prefill(model, context) for name, model in models.items()}
    forwards = {
        name: (lambda ids, model=model, cache=caches[name]: timed_forward(model, cache, ids))
        for name, model in models.items()
    }
    interleaved_ratios(forwards, rows, mask_id, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--builds", default="worktree", help="comma list: worktree, a git revision, worktree@N"
    )
    parser.add_argument(
        "--checkpoint", default="embedded-mars", help="a gated adapter folder or 'embedded-mars'"
    )
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--cpu-kernels", choices=("stock", "packed"), default="packed")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument(
        "--base",
        choices=("model", "same-copy"),
        default="model",
        help="the forward each gated one is divided by: the base model's (a copy of its own), or the gated model's "
        "own on as many real tokens, which skips the adapter (no copy's place in memory in the ratio; kernel builds "
        "only)",
    )
    parser.add_argument(
        "--whole-adapter",
        action="store_true",
        help="compare gated_lora + gated_kernel of each build, not the kernel",
    )
    args = parser.parse_args()
    builds = [name.strip() for name in args.builds.split(",") if name.strip()]
    checkpoint = Path(resolve_model_path(args.checkpoint))
    mask_id = int(json.loads((checkpoint / "mars_config.json").read_text())["mask_token_id"])
    print(f"CPU: {cpu_description()}")
    print(
        f"adapter: {args.checkpoint}; {args.cpu_kernels} linear kernels; {args.repeats} interleaved repeats, medians; "
        f"base forward: {'the gated model on real tokens only' if args.base == 'same-copy' else 'the base model'}\n"
    )
    rows = [int(n) for n in args.rows.split(",")]
    if args.whole_adapter and args.base == "same-copy":
        parser.error("--base same-copy compares kernel builds in one gated model; --whole-adapter loads a copy per build")
    with tempfile.TemporaryDirectory() as scratch:
        if args.whole_adapter:
            packages = {name: load_adapter_package(name, Path(scratch)) for name in builds}
        else:
            kernels = {}
            for name in builds:
                module = load_build(name, Path(scratch))
                kernels[name] = kernel_functions(module)
                if hasattr(module, "min_parallel_work"):  # builds before this script's commit do not say
                    print(
                        f"{name}: a call splits over threads from {module.min_parallel_work()} multiply-adds"
                    )
        original = gated_lora.GroupPlan, gated_lora.mask_rows_group_delta
        try:
            for dtype_name in args.dtypes.split(","):
                dtype = getattr(torch, dtype_name.strip())
                print(dtype_name)
                with contextlib.ExitStack() as stack:
                    if args.whole_adapter:
                        models = load_variants(embedded_model_dir(), checkpoint, dtype, ["base"])
                        for name, package in packages.items():
                            models[name] = AutoModelForCausalLM.from_pretrained(
                                embedded_model_dir(), dtype=dtype
                            )
                            assert package.attach_shipped_adapter(models[name].eval(), checkpoint, kernel="c")
                        for model in models.values():
                            stack.enter_context(packed_linears(model, args.cpu_kernels))
                        compare_adapters(models, mask_id, rows, args.repeats)
                    else:
                        # one call: load_variants loads the base model whatever it is asked for; with --base same-copy
                        # it is left aside (and unpacked), the gated model divided by itself
                        models = load_variants(embedded_model_dir(), checkpoint, dtype, ["base", "gated"])
                        base = None if args.base == "same-copy" else models["base"]
                        for model in (base, models["gated"]):
                            if model is not None:
                                stack.enter_context(packed_linears(model, args.cpu_kernels))
                        compare_kernels(base, models["gated"], kernels, mask_id, rows, args.repeats)
        finally:
            gated_lora.GroupPlan, gated_lora.mask_rows_group_delta = original


if __name__ == "__main__":
    sys.exit(main())
