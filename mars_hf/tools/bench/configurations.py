"""The benchmark's grid: stock `generate`, and MARS per τ, window, cache scheme and verify layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mars_hf.decoding.acceptance import one_token_per_step

SCHEMES = ("stock", "none", "cursor", "block")
# How our commands feed τ rows' masks: "planned", the step planner sizes each step's mask group from what τ has
# kept (``mars_planner=True``: where masks do not pay they are not fed, which changes the tokens τ can accept,
# MARS_SPEC §8), or "fixed", the paper's window W at every step (``generate``'s own default).
TAU_WINDOWS = ("planned", "fixed")
DEFAULT_TAU_WINDOW = "planned"


def tau_feed_kwargs(tau_window: str) -> dict:
    """``generate`` keywords of a τ row fed as ``tau_window`` says (harmless at τ = 1: no masks to plan)."""
    if tau_window not in TAU_WINDOWS:
        raise ValueError(f"tau_window must be one of {list(TAU_WINDOWS)}, got {tau_window!r}.")
    return {"mars_planner": True} if tau_window == "planned" else {}


@dataclass(frozen=True)
class BenchConfiguration:
    """One decoding configuration: stock `generate`, or MARS with a cache scheme; ``lookup`` adds
    prompt lookup (``prompt_lookup_num_tokens``): transformers' own with stock, or verified drafts."""

    scheme: str
    tau: float | None = None
    window: int | None = None
    cache_block: int | None = None
    layout: str | None = None  # verified decoding (mars_acceptance="verify", no τ): auto, linear, quadratic
    lookup: int | None = None
    cpu_kernels: str = "auto"  # mars_cpu_kernels of a MARS row; "packed" on a stock row: the kernels' share
    masks: str = "trained"  # "untrained": the base model with a mean-initialized mask row (untrained.py)
    compiled: bool = (
        False  # transformers' fast path: a static cache and the compiled forward (compile_config)
    )
    tau_window: str = DEFAULT_TAU_WINDOW  # a τ row's feed (TAU_WINDOWS)

    @property
    def verify(self) -> bool:
        return self.layout is not None

    @property
    def label(self) -> str:
        if self.scheme == "stock":
            label = f"stock prompt-lookup={self.lookup}" if self.lookup else "stock"
        else:
            label = (
                f"{self.scheme} verify-{self.layout}" if self.verify else f"{self.scheme} tau={self.tau:g}"
            )
            label += f" W={self.window}" + (f" prompt-lookup={self.lookup}" if self.lookup else "")
            label += f" C={self.cache_block}" if self.cache_block is not None else ""
        label += f" kernels={self.cpu_kernels}" if self.cpu_kernels != "auto" else ""
        label += " compiled" if self.compiled else ""
        label += (
            f" window={self.tau_window}" if self.tau_window != DEFAULT_TAU_WINDOW and self.feeds_tau else ""
        )
        return label + (" masks=untrained" if self.untrained else "")

    @property
    def feeds_tau(self) -> bool:
        """A τ row below 1 with a cache (its masks fed as ``tau_window`` says). Without one (``none``) every step
        recomputes the whole sequence, which the planner's curve (priced per fed column) does not describe: such
        rows keep the paper's window."""
        return (
            self.scheme in ("cursor", "block") and not self.verify and self.tau is not None and self.tau < 1.0
        )

    @property
    def untrained(self) -> bool:
        return self.masks == "untrained"

    def generate_kwargs(self, acceptance: str, device: str = "cpu") -> dict:
        path = compiled_path(stock=self.scheme == "stock", device=device) if self.compiled else {}
        if self.scheme == "stock":
            return {**path, **({"prompt_lookup_num_tokens": self.lookup} if self.lookup else {})}
        kwargs = {"mars_block_size": self.window, "mars_cache": self.scheme, **path}
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = self.lookup
        if self.verify:
            kwargs.update(mars_acceptance="verify", mars_layout=self.layout)
        else:
            kwargs.update(mars_threshold=self.tau, mars_acceptance=acceptance)
            if self.feeds_tau:  # τ < 1: never one token per step
                kwargs.update(tau_feed_kwargs(self.tau_window))
        if self.cache_block is not None:
            kwargs["mars_cache_block"] = self.cache_block
        kwargs["mars_cpu_kernels"] = self.cpu_kernels  # named always: generate's own default is "stock"
        return kwargs


def fast_compile_config(device: str = "cpu", stock: bool = False, freezing: bool = True):
    """The ``CompileConfig`` our commands decode with: Inductor, ``fullgraph`` (a graph break fails loudly instead
    of falling back); on an accelerator transformers' default mode (CUDA graphs). On a CPU MARS decodes with weight
    freezing where the steps are timed (decoding runs without gradients, so the weights are constants Inductor
    prepacks: a step of SmolLM2 in bf16 about 1.4× faster here, docs/lab/fast_path_log.md), without it where the
    compile is (``freezing=False``, `mars-hf generate`): freezing bypasses AOTAutograd's on-disk cache, so every
    process compiles anew. Stock ``generate`` gets no freezing (``stock``): in transformers' own loop the option never
    reaches the traced graph, and set globally it would freeze transformers' static cache (its buffers have static
    addresses) into the graph. MARS compiles on any device when given a config; stock ``generate`` on a CPU only with
    the config's own switch for that (``_compile_all_devices``), which ``stock`` sets."""
    from transformers import CompileConfig

    if str(device).split(":")[0] == "cpu":
        options = {"freezing": True} if freezing and not stock else {}
        config = CompileConfig(fullgraph=True, mode=None, options=options)
    else:
        config = CompileConfig(fullgraph=True)
    if stock:
        config._compile_all_devices = True
    return config


def compiled_path(stock: bool = False, device: str = "cpu", freezing: bool = True) -> dict:
    """``generate`` keywords of transformers' fast path: a static cache and :func:`fast_compile_config`."""
    return {"cache_implementation": "static", "compile_config": fast_compile_config(device, stock, freezing)}


# Room for a compiled MARS row's widest step (``decoder.widest_step``: the fresh token, drafts, mask groups) on
# top of the prompt and its new tokens; a row that needs more gets a larger cache (and one more compile).
STEP_ROOM = 128


def one_cache_length(batches, max_new_tokens: int) -> int:
    """One static cache size (``generation_config.max_cache_len``) for every compiled call of a benchmark: the
    longest prompt, its new tokens and :data:`STEP_ROOM`, rounded up to the cache's step. Each prompt sized its
    own cache otherwise, and a prompt crossing a size compiled every graph again in the middle of the timing."""
    from mars_hf.decoding.generation import static_capacity

    longest = max(int(inputs["input_ids"].shape[1]) for inputs in batches)
    return static_capacity(longest + max_new_tokens + STEP_ROOM)


def build_configurations(
    taus,
    windows,
    schemes=("stock", "none", "cursor", "block"),
    cache_blocks=("W", 16, 32),
    acceptance: str = "probability",
    one_token_schemes=("cursor",),
    verify_layouts=(),
    lookup_tokens=(),
    cpu_kernels=("auto",),
    untrained_masks: bool = False,
    compiled: bool = False,
    tau_window: str = DEFAULT_TAU_WINDOW,
) -> list[BenchConfiguration]:
    """The grid, stock first. ``cache_blocks`` may hold ``"W"`` (C = the window). In one-token mode
    (τ ≥ 1 with the probability or margin metric: ``one_token_per_step``) the schemes all do the same
    work, so only ``one_token_schemes`` run there. Each of ``verify_layouts`` adds verified decoding
    (cursor scheme) for every window. Each k of ``lookup_tokens`` adds transformers' prompt lookup
    (stock ``generate``, batch 1 only) and every verify row again with prompt-lookup drafts. Every MARS row
    runs once per ``cpu_kernels`` mode (``mars_cpu_kernels``). With ``untrained_masks``, every verify row of
    the planner (layout ``auto``, no prompt lookup) runs again on the untrained-mask model (``masks``). With
    ``compiled``, every MARS row runs on transformers' fast path (static cache, compiled forward: the fixed feed)
    and stock ``generate`` runs there too (``stock compiled``, their MARS-off) besides the eager stock row.
    ``tau_window``: how τ rows feed their masks (:data:`TAU_WINDOWS`)."""
    tau_feed_kwargs(tau_window)  # checks it
    unknown = set(schemes) - set(SCHEMES)
    if unknown:
        raise ValueError(f"Unknown scheme(s) {sorted(unknown)}; choose from {list(SCHEMES)}.")
    configurations = [BenchConfiguration("stock")] if "stock" in schemes else []
    for tau in taus:
        for window in windows:
            for scheme in schemes:
                if scheme == "stock":
                    continue
                if one_token_per_step(acceptance, tau) and scheme not in one_token_schemes:
                    continue
                row = BenchConfiguration(scheme, float(tau), int(window), tau_window=tau_window)
                if scheme != "block":
                    configurations.append(row)
                    continue
                blocks = sorted({int(window) if str(c).upper() == "W" else int(c) for c in cache_blocks})
                configurations += [dataclasses.replace(row, cache_block=block) for block in blocks]
    for window in windows:
        for layout in verify_layouts:
            configurations.append(BenchConfiguration("cursor", None, int(window), None, layout))
    for k in lookup_tokens:
        if "stock" in schemes:
            configurations.append(BenchConfiguration("stock", lookup=int(k)))
        for window in windows:
            for layout in verify_layouts:
                configurations.append(BenchConfiguration("cursor", None, int(window), None, layout, int(k)))
    configurations = [
        dataclasses.replace(c, cpu_kernels=mode) if c.scheme != "stock" else c
        for c in configurations
        for mode in (cpu_kernels if c.scheme != "stock" else ("auto",))
    ]
    if compiled:
        configurations = [
            c if c.scheme == "stock" else dataclasses.replace(c, compiled=True) for c in configurations
        ]
        if "stock" in schemes:
            configurations.insert(1, BenchConfiguration("stock", compiled=True))
    if untrained_masks:
        configurations += [
            dataclasses.replace(c, masks="untrained")
            for c in configurations
            if c.layout == "auto" and not c.lookup
        ]
    return list(dict.fromkeys(configurations))
