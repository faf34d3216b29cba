"""A prepared GPU check: MARS decoding and training on random weights of real shapes, in one budgeted run.

Why random weights: the check must run on a machine without network or Hub, and speed does not depend
on what the weights say, only on their shapes and on how many tokens each forward accepts. That number
is *forced* instead of learned (see `ForcedAcceptance`): the model's own next-token prediction becomes
a known function of the position, and each mask's prediction agrees with it at a chosen rate, with a
peaked distribution (so thresholds pass) or, where it disagrees, a wrong token at probability ~0.62 (so
thresholds fail and verification rejects it). The forced logits are written by a hook on the LM head
inside the model's forward, after the real head has run, so every forward costs what it really costs.

Each measurement is one *item* (a model build, a decoding group = one model x rate x batch size with every
configuration interleaved, an exactness check, a training step). Items run in priority order; before
each, its cost is estimated from what has been measured so far, and an item that does not fit the rest
of ``--budget-seconds`` is skipped and recorded with the reason. A timer also interrupts a running item
at the deadline. The JSON is rewritten after every item, so a killed run still leaves its results.

``--tiny`` runs the same plan with tiny shapes on the CPU (the test suite runs it).
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import math
import os
import platform
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from mars_hf.tools.bench import (
    BenchConfiguration,
    ForwardCounter,
    _summarise,
    count_generated_tokens,
    planner_choices,
    run_once,
)

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1

# Shapes of the Qwen2.5 family (their config.json values; the weights are random). The mask token is the
# first unused embedding row past the real tokenizer's 151665 tokens, where `add_mask_token` would put it.
MODEL_SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=2,
        mask_token_id=511,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=151645,
        pad_token_id=151643,
        mask_token_id=151665,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=151645,
        pad_token_id=151643,
        mask_token_id=151665,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=151645,
        pad_token_id=151643,
        mask_token_id=151665,
    ),
}
TRAINING_FIX = "bring their wheels (docs/gpu_check.md)"
FLEX_NEEDS_CUDA = "flex_attention has no backward on the CPU (torch raises NotImplementedError); CUDA only"
# Costs assumed before anything is measured (seconds); replaced by measurements as soon as there are any.
PRIOR_FLEX_COMPILE_SECONDS = 60.0  # compiling flex attention's forward and backward kernels
PRIOR_MARS_STEP_FACTOR = 2.5  # a MARS step against a stock step of the same batch (more Python per step)
PRIOR_NONE_STEP_FACTOR = 4.0  # 'none' recomputes the whole sequence every step
PRIOR_BUILD_SECONDS_PER_BILLION = {"cuda": 8.0, "cpu": 60.0}


class BudgetExceeded(BaseException):
    """Raised (by the deadline timer or a check between runs) when the budget is spent. A BaseException,
    like KeyboardInterrupt, so that no ``except Exception`` inside a library swallows it."""


# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------


@dataclass
class GPUCheckArguments:
    """What to measure. Defaults are the GPU plan; `tiny_arguments` gives the CPU plan of ``--tiny``."""

    models: list[str] = field(
        default_factory=lambda: ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"],
        metadata={"help": f"Model shapes, in priority order ({', '.join(MODEL_SHAPES)})."},
    )
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16], metadata={"help": "Batch sizes."})
    rates: list[float] = field(
        default_factory=lambda: [0.4, 0.8],
        metadata={"help": "Forced mask agreement rates (0.4 is paper-like: ~1.65 tokens/step at W=4)."},
    )
    window: int = field(default=4, metadata={"help": "MARS window W (masks per step)."})
    tau: float = field(default=0.9, metadata={"help": "Threshold τ of the threshold (probability) rows."})
    cache_blocks: list[int] = field(default_factory=lambda: [16, 32], metadata={"help": "Block sizes C."})
    layouts: list[str] = field(
        default_factory=lambda: ["auto", "linear", "quadratic"],
        metadata={"help": "Verify draft layouts (auto = the step planner on the measured cost curve)."},
    )
    max_new_tokens: int = field(default=64, metadata={"help": "New tokens per row (greedy)."})
    prompt_length: int = field(default=128, metadata={"help": "Longest prompt (rows vary by up to 15)."})
    repeats: int = field(default=3, metadata={"help": "Timed repeats per configuration (median)."})
    warmup: int = field(default=1, metadata={"help": "Untimed short runs per configuration first."})
    warmup_tokens: int = field(default=8, metadata={"help": "New tokens of a warm-up run."})
    parts: list[str] = field(
        default_factory=lambda: ["decode", "exactness", "training"],
        metadata={"help": "What to run: any of decode, exactness, training."},
    )
    exactness_batch_sizes: list[int] = field(
        default_factory=lambda: [1, 8], metadata={"help": "Batch sizes of the bf16 exactness check."}
    )
    exactness_new_tokens: int = field(default=64, metadata={"help": "New tokens of the exactness check."})
    train_batch: int = field(default=4, metadata={"help": "Rows of the training step."})
    train_length: int = field(default=512, metadata={"help": "Tokens per row of the training step."})
    train_repeats: int = field(default=3, metadata={"help": "Timed training steps per backend (median)."})
    train_models: int = field(default=2, metadata={"help": "Train-check the first N model shapes."})
    dtype: str = field(default="bfloat16", metadata={"help": "Decoding dtype (training runs in float32)."})
    device: str | None = field(default=None, metadata={"help": "Device (default: cuda if available)."})
    seed: int = field(default=0, metadata={"help": "Seed of weights, prompts and forced patterns."})


def tiny_arguments(**overrides) -> GPUCheckArguments:
    """The ``--tiny`` plan: tiny shapes on the CPU, the same items and JSON as the GPU plan."""
    values = dict(
        models=["tiny"],
        batch_sizes=[1, 2],
        max_new_tokens=32,
        prompt_length=16,
        repeats=2,
        exactness_batch_sizes=[1, 3],
        exactness_new_tokens=24,
        train_batch=2,
        train_length=32,
        train_repeats=2,
        train_models=1,
        device="cpu",
    )
    values.update(overrides)
    return GPUCheckArguments(**values)


# --------------------------------------------------------------------------------------------------
# Random models of real shapes, and the forced acceptance
# --------------------------------------------------------------------------------------------------


def build_model(shape: str, *, dtype: torch.dtype, device, seed: int, attn_implementation: str = "sdpa"):
    """A random Qwen2 model of the named shape on ``device`` with a mask token and ``config.mars``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mars_hf.decoding.generation import enable_mars
    from mars_hf.models.mask_token import set_mars_config, suppress_mask_token

    if shape not in MODEL_SHAPES:
        raise ValueError(f"Unknown model shape {shape!r}; choose from {list(MODEL_SHAPES)}.")
    values = dict(MODEL_SHAPES[shape])
    mask_token_id = values.pop("mask_token_id")
    config = Qwen2Config(bos_token_id=None, use_sliding_window=False, **values)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.eval()
    set_mars_config(model, block_size=4, mask_token_id=mask_token_id)
    model.generation_config.eos_token_id = values["eos_token_id"]
    model.generation_config.pad_token_id = values["pad_token_id"]
    suppress_mask_token(model)  # as every MARS checkpoint does (MARSTrainer writes it)
    return enable_mars(model)


def ordinary_token_ids(model) -> torch.Tensor:
    """Ids the forced predictions and the prompts use: every row except EOS, pad and the mask token."""
    vocab = model.get_output_embeddings().weight.shape[0]
    special = {model.config.eos_token_id, model.config.pad_token_id, model.config.mars["mask_token_id"]}
    return torch.tensor([i for i in range(3, min(vocab, 32768)) if i not in special], dtype=torch.long)


def _select_kept(values: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """``values[b, t]`` at the positions the LM head saw (transformers' ``logits_to_keep`` rule)."""
    if isinstance(logits_to_keep, int):
        return values if logits_to_keep == 0 else values[:, -logits_to_keep:]
    if logits_to_keep.dim() == 1:
        return values[:, logits_to_keep]
    if logits_to_keep.dtype == torch.bool:
        return values[logits_to_keep]
    return values.gather(1, logits_to_keep)


class ForcedAcceptance:
    """Make a random model's predictions a known function of the position, from inside its forward.

    The logit at position ``p`` predicts the token at ``p + 1``. For a real token it becomes
    ``correct[p + 1]`` with probability ~1 (a peak of ``peak`` over logits of a few units), whatever the
    token: so stock greedy decoding outputs ``correct[t]`` at every generated position ``t``. For a mask
    token at ``p`` the prediction is the same ``correct[p + 1]`` (peaked) when ``agree[p + 1]`` holds,
    which happens for a share ``rate`` of the positions (a fixed pseudo-random pattern), and otherwise a
    wrong token at probability ~0.62 next to a second wrong one: below any τ > 0.63, and rejected by
    verification. Position-based (not token-based) so that every layout (linear, quadratic groups with
    their own position ids) and cache scheme sees the same pattern.

    The hooks capture the input ids (embedding), the position ids (rotary embedding, i.e. those the
    model really used) and ``logits_to_keep`` (the model's forward), and overwrite three logits per
    position after the LM head: the head's matrix product still runs, so forwards cost what they cost.
    """

    TABLE = 1 << 15
    PEAK = 40.0
    DECOY_GAP = 0.5

    def __init__(self, model, rate: float, seed: int = 0):
        self.model = model
        self.mask_token_id = int(model.config.mars["mask_token_id"])
        self.enabled = True
        device = model.get_output_embeddings().weight.device
        ordinary = ordinary_token_ids(model)
        generator = torch.Generator().manual_seed(seed + 1)
        index = torch.randint(len(ordinary), (self.TABLE,), generator=generator)
        shift = torch.randint(1, len(ordinary) // 2, (self.TABLE,), generator=generator)
        self.correct_cpu = ordinary[index]
        self.correct = self.correct_cpu.to(device)
        self.decoy = ordinary[(index + shift) % len(ordinary)].to(device)
        self.decoy2 = ordinary[(index + 2 * shift) % len(ordinary)].to(device)
        self.uniform_cpu = torch.rand(self.TABLE, generator=generator)
        self.set_rate(rate)
        self._ids = self._positions = None
        self._keep = 0
        rotary = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
        self._handles = [
            model.register_forward_pre_hook(self._on_model, with_kwargs=True),
            model.get_input_embeddings().register_forward_pre_hook(self._on_embedding),
            rotary.register_forward_pre_hook(self._on_rotary, with_kwargs=True),
            model.get_output_embeddings().register_forward_hook(self._on_logits),
        ]

    def set_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"A forced agreement rate is a probability, got {rate}.")
        self.rate = float(rate)
        self.agree_cpu = self.uniform_cpu < self.rate
        self.agree = self.agree_cpu.to(self.correct.device)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _on_model(self, module, args, kwargs):
        self._keep = kwargs.get("logits_to_keep", 0)

    def _on_embedding(self, module, args):
        self._ids = args[0]

    def _on_rotary(self, module, args, kwargs):
        self._positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)

    @torch.no_grad()
    def _on_logits(self, module, args, output):
        if not self.enabled or self._ids is None or self._positions is None:
            return None
        ids = self._ids
        positions = self._positions.expand_as(ids)
        ids = _select_kept(ids, self._keep).reshape(output.shape[:-1])
        target = (_select_kept(positions, self._keep).reshape(output.shape[:-1]) + 1) % self.TABLE
        hit = (ids != self.mask_token_id) | self.agree[target]
        first = torch.where(hit, self.correct[target], self.decoy[target])
        second = torch.where(hit, self.decoy[target], self.decoy2[target])
        second_value = torch.where(hit, 0.0, self.PEAK - self.DECOY_GAP).to(output.dtype)
        output.scatter_(-1, second[..., None], second_value[..., None])
        output.scatter_(-1, first[..., None], torch.full_like(second_value[..., None], self.PEAK))
        return output

    def expected_tokens_per_step(self, window: int) -> float:
        """1 + r + … + r^W: what one threshold step accepts on average (independent agreements)."""
        return sum(self.rate**k for k in range(window + 1))

    def simulate_steps(self, last_positions: list[int], new_tokens: int, window: int) -> list[int]:
        """Threshold steps each row needs under this pattern (MARS_SPEC §2 rule, exact): the forwards of
        the cursor and none schemes are the maximum over the rows."""
        steps = []
        agree = self.agree_cpu.tolist()
        for anchor in last_positions:
            done = count = 0
            while done < new_tokens:
                count += 1
                accepted = 1
                while accepted <= window and done + accepted < new_tokens:
                    if not agree[(anchor + 1 + accepted) % self.TABLE]:
                        break
                    accepted += 1
                done += accepted
                anchor += accepted
            steps.append(count)
        return steps


def make_prompts(model, batch: int, length: int, seed: int, device) -> dict:
    """``batch`` random prompts of ordinary tokens, left-padded; row ``i`` is ``(7 i) mod 16`` shorter
    than ``length`` so that rows sit at different positions (and so follow different forced patterns)."""
    ordinary = ordinary_token_ids(model)
    generator = torch.Generator().manual_seed(seed + 1000 + batch)
    pad = int(model.config.pad_token_id)
    input_ids = torch.full((batch, length), pad, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for row in range(batch):
        n = length - (7 * row) % min(16, max(1, length // 2))
        input_ids[row, length - n :] = ordinary[torch.randint(len(ordinary), (n,), generator=generator)]
        attention_mask[row, length - n :] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


# --------------------------------------------------------------------------------------------------
# Decoding configurations
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckConfiguration(BenchConfiguration):
    """A `bench` configuration plus the acceptance rule and verify's draft layout."""

    acceptance: str = "probability"
    layout: str | None = None

    @property
    def label(self) -> str:
        if self.acceptance == "verify":
            return f"verify {self.layout} W={self.window}"
        return super().label

    def generate_kwargs(self, acceptance: str | None = None) -> dict:
        if self.acceptance != "verify":
            return super().generate_kwargs(self.acceptance)
        kwargs = {"mars_acceptance": "verify", "mars_layout": self.layout, "mars_block_size": self.window}
        if self.tau is not None:
            kwargs["mars_threshold"] = self.tau  # verify's proposal floor
        return kwargs


STOCK = BenchConfiguration("stock")


def decoding_configurations(args: GPUCheckArguments) -> list[BenchConfiguration]:
    configurations = [STOCK, CheckConfiguration("cursor", args.tau, args.window)]
    configurations += [CheckConfiguration("block", args.tau, args.window, c) for c in args.cache_blocks]
    configurations.append(CheckConfiguration("none", args.tau, args.window))
    configurations += [
        CheckConfiguration("verify", None, args.window, acceptance="verify", layout=layout)
        for layout in args.layouts
    ]
    return configurations


def greedy_generation_config(model, max_new_tokens: int, output_logits: bool = False):
    """The model's generation config made greedy, of exactly ``max_new_tokens``, with a dict output."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.max_new_tokens = max_new_tokens
    config.max_length = None
    config.return_dict_in_generate = True
    config.output_logits = output_logits
    return config


class _Synchronized:
    """``generate`` with ``torch.cuda.synchronize`` on both sides, so that `bench.run_once`'s wall clock
    covers all of the generation's GPU work (not only its launches)."""

    def __init__(self, model):
        self.model = model
        self.cuda = next(model.parameters()).is_cuda
        self.drafts = None  # (proposed, accepted) of the last generation, when it reports them (verify)

    def generate(self, *args, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        output = self.model.generate(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        proposed = getattr(output, "drafts_proposed", None)
        accepted = getattr(output, "drafts_accepted", None)
        self.drafts = (
            None if proposed is None or accepted is None else (int(proposed.sum()), int(accepted.sum()))
        )
        return output


# --------------------------------------------------------------------------------------------------
# The run: budget, items, results
# --------------------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget with a hard deadline: `check` between runs, and a timer that interrupts.

    The timer's exception is raised when the main thread next runs Python, so a single long C++ call
    (one forward or backward: milliseconds on a GPU, seconds for a large model on a CPU) finishes first.
    ``clock`` (seconds, default ``time.monotonic``) can be replaced, e.g. by one that charges a fixed cost
    per generated token so that where a run stops does not depend on the machine's speed (the tests); the
    timer only runs on the real clock, a replaced one is read by the checks between runs alone.
    """

    def __init__(
        self, seconds: float, reserve: float | None = None, start: float | None = None, clock=time.monotonic
    ):
        self.seconds = float(seconds)
        self.clock = clock
        # Room for the JSON and for the one C++ call (a forward, a backward) an interrupt has to wait for.
        reserve = min(3.0, 0.05 * self.seconds) if reserve is None else reserve
        self.start = clock() if start is None else start
        self.deadline = self.start + max(0.0, self.seconds - reserve)
        self._timer = False

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float:
        return self.deadline - self.clock()

    def check(self) -> None:
        if self.remaining() <= 0:
            raise BudgetExceeded(f"the budget of {self.seconds:g} s is spent")

    def arm(self) -> None:
        """Interrupt whatever runs at the deadline (main thread, Unix); `disarm` when done."""
        if not hasattr(signal, "setitimer") or self.clock is not time.monotonic:
            return
        try:
            signal.signal(signal.SIGALRM, self._ring)
        except ValueError:  # not the main thread: the checks between runs still stop the run
            return
        signal.setitimer(signal.ITIMER_REAL, max(0.01, self.remaining()))
        self._timer = True

    def disarm(self) -> None:
        if self._timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            self._timer = False

    def _ring(self, signum, frame):
        raise BudgetExceeded(f"interrupted at the deadline of the {self.seconds:g} s budget")


def _peak_memory_reset(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_mb(device) -> float | None:
    """Peak allocated GPU memory since the last reset (MiB); None on the CPU (see ``max_rss_mb``)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return None


def _max_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class GPUCheck:
    """Runs the plan item by item within the budget and keeps the JSON-able result up to date."""

    def __init__(
        self,
        args: GPUCheckArguments,
        budget_seconds: float,
        out: str | None = None,
        start: float | None = None,
        clock=time.monotonic,
    ):
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, args.dtype)
        self.clock = clock  # every duration the plan's decisions use is read from it (see `Budget`)
        self.budget = Budget(budget_seconds, start=start, clock=clock)
        self.out = out
        self.models: dict = {}
        # seconds per stock forward, per (model, batch), from the probes; MARS step factors per label
        self.step_seconds: dict = {}
        self.factors: dict = {}
        self.result = {
            "schema_version": SCHEMA_VERSION,
            "environment": self._environment(),
            "arguments": asdict(args),
            "budget": {"budget_seconds": float(budget_seconds), "elapsed_seconds": 0.0, "stopped": None},
            "models": {},
            "rows": [],
            "exactness": [],
            "training": [],
            "skipped": [],
            "items": [],
        }

    # ------------------------------------------------------------------------------------ helpers
    def _environment(self) -> dict:
        import transformers

        env = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else platform.processor() or platform.machine(),
            "cuda": torch.version.cuda,
            "threads": torch.get_num_threads(),
            "dtype": self.args.dtype,
        }
        from importlib.metadata import PackageNotFoundError, version

        for package in ("trl", "peft", "accelerate", "mars-hf"):
            try:
                env[package] = version(package)
            except PackageNotFoundError:
                env[package] = None
        return env

    def _write(self) -> None:
        self.result["budget"]["elapsed_seconds"] = round(self.budget.elapsed(), 2)
        self.result["environment"]["max_rss_mb"] = _max_rss_mb()
        if self.out:
            tmp = self.out + ".tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(self.result, handle, indent=1)
            os.replace(tmp, self.out)

    def skip(self, item: str, reason: str) -> None:
        logger.warning("gpu-check: skipping %s: %s", item, reason)
        self.result["skipped"].append({"item": item, "reason": reason})

    def _run_item(self, item: str, estimate: float | None, function, *args) -> bool:
        """Run one item if its estimated cost fits what is left; record it (or why it was skipped)."""
        left = self.budget.remaining()
        if self.result["budget"]["stopped"] is not None and left <= 0:
            self.skip(item, "the budget was spent before it")
            return False
        if estimate is not None and estimate > left:
            self.skip(item, f"estimated {estimate:.1f} s, {max(left, 0):.1f} s of the budget left")
            return False
        start = self.clock()
        record = {"item": item, "estimated_seconds": estimate, "seconds": None, "status": "ran"}
        try:
            self.budget.arm()
            function(*args)
        except BudgetExceeded as error:
            record["status"] = "interrupted"
            self.result["budget"]["stopped"] = str(error)
            self.skip(item, f"stopped: {error}")
        except Exception as error:  # one broken item must not cost the rest of a scarce GPU window
            import traceback

            record["status"] = "error"
            record["error"] = f"{type(error).__name__}: {error}"
            record["traceback"] = traceback.format_exc(limit=8)
            logger.error("gpu-check: %s failed:\n%s", item, record["traceback"])
        finally:
            self.budget.disarm()
            record["seconds"] = round(self.clock() - start, 3)
            self.result["items"].append(record)
            self._write()
        logger.info(
            "gpu-check [%5.0f s / %.0f s] %s: %s in %.1f s",
            self.budget.elapsed(),
            self.budget.seconds,
            item,
            record["status"],
            record["seconds"],
        )
        return record["status"] == "ran"

    # ------------------------------------------------------------------------------------- the plan
    def run(self) -> dict:
        args = self.args
        unknown = set(args.parts) - {"decode", "exactness", "training"}
        if unknown:
            raise ValueError(f"Unknown part(s) {sorted(unknown)}; choose from decode, exactness, training.")
        unknown = [m for m in args.models if m not in MODEL_SHAPES]
        if unknown:
            raise ValueError(f"Unknown model shape(s) {unknown}; choose from {list(MODEL_SHAPES)}.")
        self._write()
        for index, shape in enumerate(args.models):
            plan = self._plan(shape, index)
            if not self._run_item(f"{shape}: build", self._estimate_build(shape), self._build, shape):
                for name, _ in plan:
                    self.skip(name, f"not run: the {shape} model was not built")
                continue
            self._run_item(f"{shape}: probe", None, self._probe, shape)
            for _, runner in plan:
                runner()
            self._release(shape)
        self._write()
        return self.result

    def _plan(self, shape: str, index: int) -> list:
        """``(name, runner)`` of one model's item groups in priority order: the first (paper-like) rate at
        the first two batch sizes; exactness (first model only) and training, the paths no CPU test
        reaches; the first rate at the other batch sizes; then the other rates."""
        args = self.args
        decode = "decode" in args.parts
        first, rest = list(args.rates[:1]), list(args.rates[1:])
        batches = list(args.batch_sizes)

        def decoding(rates, batch_sizes):
            return [
                (f"{shape}: decode rate={rate:g} batch={b}", partial(self._decode_item, shape, rate, b))
                for rate in (rates if decode else [])
                for b in batch_sizes
            ]

        plan = decoding(first, batches[:2])
        if index == 0 and "exactness" in args.parts:
            plan.append((f"{shape}: exactness", partial(self._exactness_item, shape)))
        if shape in args.models[: args.train_models] and "training" in args.parts:
            plan.append((f"{shape}: training", partial(self._training_items, shape)))
        return plan + decoding(first, batches[2:]) + decoding(rest, batches)

    def _release(self, shape: str) -> None:
        entry = self.models.pop(shape, None)
        if entry is not None:
            entry["forcer"].remove()
        del entry
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------- build + probe
    def _estimate_build(self, shape: str) -> float:
        values = MODEL_SHAPES[shape]
        h, i, n, v = (
            values[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        )
        params = n * (4 * h * h + 3 * h * i) + v * h * (1 if values["tie_word_embeddings"] else 2)
        return params / 1e9 * PRIOR_BUILD_SECONDS_PER_BILLION[self.device.type] + 1.0

    def _build(self, shape: str) -> None:
        start = self.clock()
        model = build_model(shape, dtype=self.dtype, device=self.device, seed=self.args.seed)
        forcer = ForcedAcceptance(model, self.args.rates[0], seed=self.args.seed)
        seconds = self.clock() - start
        self.models[shape] = {"model": model, "forcer": forcer}
        params = sum(p.numel() for p in model.parameters())
        self.result["models"][shape] = {
            "parameters": params,
            "config": {k: v for k, v in MODEL_SHAPES[shape].items()},
            "dtype": self.args.dtype,
            "build_seconds": round(seconds, 3),
        }

    def _probe(self, shape: str) -> None:
        """Seconds per stock forward at each batch size (a short greedy generation, after a warm-up)."""
        model = self.models[shape]["model"]
        generator = _Synchronized(model)
        tokens = 8
        config = greedy_generation_config(model, tokens)
        for batch in sorted(set(self.args.batch_sizes) | set(self.args.exactness_batch_sizes)):
            inputs = make_prompts(model, batch, self.args.prompt_length, self.args.seed, self.device)
            generator.generate(**inputs, generation_config=config)  # warm-up
            start = self.clock()
            generator.generate(**inputs, generation_config=config)
            self.step_seconds[(shape, batch)] = (self.clock() - start) / tokens
            self.budget.check()
        self.result["models"][shape]["stock_step_seconds"] = {
            str(b): s for (m, b), s in self.step_seconds.items() if m == shape
        }

    # ---------------------------------------------------------------------------------- decoding
    def _forwards_estimate(self, configuration, rate: float, new_tokens: int) -> float:
        if configuration.scheme == "stock":
            return new_tokens
        per_step = sum(rate**k for k in range(self.args.window + 1))
        forwards = new_tokens / per_step
        if configuration.scheme == "block":
            forwards += new_tokens / configuration.cache_block + 1
        return forwards + 1

    def _factor(self, configuration) -> float:
        kind = configuration.label.split(" ")[0] if configuration.scheme != "stock" else "stock"
        if kind in self.factors:
            return self.factors[kind]
        if configuration.scheme == "stock":
            return 1.0
        return PRIOR_NONE_STEP_FACTOR if configuration.scheme == "none" else PRIOR_MARS_STEP_FACTOR

    def _decode_estimate(self, shape, rate, batch, configurations) -> float | None:
        step = self.step_seconds.get((shape, batch))
        if step is None:
            return None
        args = self.args
        total = 0.0
        for configuration in configurations:
            forwards = args.repeats * self._forwards_estimate(configuration, rate, args.max_new_tokens)
            forwards += args.warmup * self._forwards_estimate(configuration, rate, args.warmup_tokens)
            total += forwards * step * self._factor(configuration)
        return total

    def _decode_item(self, shape: str, rate: float, batch: int) -> None:
        configurations = decoding_configurations(self.args)
        estimate = self._decode_estimate(shape, rate, batch, configurations)
        self._run_item(
            f"{shape}: decode rate={rate:g} batch={batch}",
            estimate,
            self._decode,
            shape,
            rate,
            batch,
            configurations,
        )

    def _decode(self, shape: str, rate: float, batch: int, configurations) -> None:
        """One group: every configuration decodes the same prompts; runs interleaved, medians."""
        args = self.args
        model, forcer = self.models[shape]["model"], self.models[shape]["forcer"]
        forcer.enabled = True
        forcer.set_rate(rate)
        inputs = make_prompts(model, batch, args.prompt_length, args.seed, self.device)
        config = greedy_generation_config(model, args.max_new_tokens)
        warmup_config = greedy_generation_config(model, min(args.warmup_tokens, args.max_new_tokens))
        generator = _Synchronized(model)
        counter = ForwardCounter(model)
        measurements = {c: [] for c in configurations}
        clocked = {c: [] for c in configurations}  # seconds by self.clock: what the estimates learn from
        peaks = {c: None for c in configurations}
        drafts: dict = {}
        failed: dict = {}
        try:
            for repeat in range(args.warmup + args.repeats):
                for configuration in configurations:  # interleaved: drift hits every configuration alike
                    if configuration in failed:
                        continue
                    self.budget.check()
                    _peak_memory_reset(self.device)
                    timed = repeat >= args.warmup
                    start = self.clock()
                    try:
                        measurement = run_once(
                            generator,
                            [inputs],
                            config if timed else warmup_config,
                            configuration,
                            None,
                            counter,
                        )
                    except (ValueError, TypeError, NotImplementedError) as error:
                        if getattr(configuration, "acceptance", None) != "verify":
                            raise
                        failed[configuration] = f"failed: {type(error).__name__}: {error}"
                        continue
                    peak = _peak_memory_mb(self.device)
                    if timed:
                        clocked[configuration].append(self.clock() - start)
                        drafts[configuration] = generator.drafts
                        measurements[configuration].append(measurement)
                        if peak is not None:
                            peaks[configuration] = max(peaks[configuration] or 0.0, peak)
        finally:
            counter.remove()
        for configuration, reason in failed.items():
            self.skip(f"{shape}: decode rate={rate:g} batch={batch} {configuration.label}", reason)
            measurements.pop(configuration)
        rows = _summarise(batch, [inputs], measurements, shape)
        last_positions = (inputs["attention_mask"].sum(1) - 1).tolist()
        steps = forcer.simulate_steps(last_positions, args.max_new_tokens, args.window)
        stock_step = self.step_seconds.get((shape, batch))
        for configuration, row in zip(measurements, rows):
            acceptance = getattr(configuration, "acceptance", None)
            row.update(
                label=configuration.label,
                acceptance=acceptance,
                layout=getattr(configuration, "layout", None),
                rate=rate,
                dtype=args.dtype,
                device=str(self.device),
                peak_memory_mb=peaks[configuration],
                expected_tokens_per_step=None
                if configuration.scheme == "stock"
                else forcer.expected_tokens_per_step(args.window),
                predicted_tokens_per_forward=self._predicted_tpf(configuration, steps, batch),
            )
            proposed, accepted = drafts.get(configuration) or (None, None)
            row.update(
                drafts_proposed=proposed,
                drafts_accepted=accepted,
                draft_acceptance=accepted / proposed if proposed else None,
            )
            if stock_step and row["num_forwards"]:
                kind = configuration.label.split(" ")[0] if configuration.scheme != "stock" else "stock"
                factor = statistics.median(clocked[configuration]) / (row["num_forwards"] * stock_step)
                self.factors[kind] = max(self.factors.get(kind, 0.0), factor)
        self.result["rows"].extend(rows)

    def _predicted_tpf(self, configuration, steps: list[int], batch: int) -> float | None:
        """Tokens per forward the forced pattern implies: exact for cursor/none (forwards = the longest
        row's steps), 1 for stock, None where the scheme adds forwards of its own (block commits, verify)."""
        if configuration.scheme == "stock":
            return 1.0
        if getattr(configuration, "acceptance", None) == "verify" or configuration.scheme == "block":
            return None
        return self.args.max_new_tokens / max(steps)

    # --------------------------------------------------------------------------------- exactness
    def _exactness_item(self, shape: str) -> None:
        args = self.args
        configurations = [CheckConfiguration("cursor", 1.0, args.window)]
        configurations += [
            CheckConfiguration("verify", None, args.window, acceptance="verify", layout=layout)
            for layout in args.layouts
        ]
        for batch in args.exactness_batch_sizes:
            step = self.step_seconds.get((shape, batch))
            estimate = None
            if step is not None:
                estimate = (
                    args.exactness_new_tokens * step * (1 + sum(self._factor(c) for c in configurations))
                )
                single = self.step_seconds.get((shape, 1), step)
                estimate += args.exactness_new_tokens * single * batch if batch > 1 else 0.0
            self._run_item(
                f"{shape}: exactness batch={batch}", estimate, self._exactness, shape, batch, configurations
            )

    def _exactness(self, shape: str, batch: int, configurations) -> None:
        """τ = 1 and verify against stock greedy on the *unforced* random model in the decoding dtype.

        A row that differs is classified at its first differing token by the gap between stock's logit
        for its own token and for the other run's token: a near tie (within ``tie_tolerance``, 4 bf16
        spacings at that logit's magnitude) is a floating-point flip; anything larger would be a bug.
        """
        args = self.args
        model, forcer = self.models[shape]["model"], self.models[shape]["forcer"]
        forcer.enabled = False
        try:
            inputs = make_prompts(model, batch, args.prompt_length, args.seed + 1, self.device)
            prompt_length = inputs["input_ids"].shape[1]
            eos = [int(model.generation_config.eos_token_id)]
            generator = _Synchronized(model)

            def new_tokens(sequences, start=prompt_length):
                new = sequences[:, start:]
                lengths = count_generated_tokens(new, eos).tolist()
                return [row[:n] for row, n in zip(new.tolist(), lengths)]

            stock_config = greedy_generation_config(model, args.exactness_new_tokens, output_logits=True)
            stock = generator.generate(**inputs, generation_config=stock_config)
            stock_tokens = new_tokens(stock.sequences)
            stock_logits = torch.stack(stock.logits, dim=1).float()  # [batch, new, vocab]
            config = greedy_generation_config(model, args.exactness_new_tokens)
            record = dict(model=shape, batch=batch, dtype=args.dtype, new_tokens=args.exactness_new_tokens)
            for configuration in configurations:
                self.budget.check()
                try:
                    output = generator.generate(
                        **inputs, generation_config=config, **configuration.generate_kwargs()
                    )
                except (ValueError, TypeError, NotImplementedError) as error:
                    if configuration.acceptance != "verify":
                        raise
                    self.skip(
                        f"{shape}: exactness batch={batch} {configuration.label}",
                        f"failed: {type(error).__name__}: {error}",
                    )
                    continue
                comparison = compare_with_stock(stock_tokens, new_tokens(output.sequences), stock_logits)
                self.result["exactness"].append(
                    dict(
                        record,
                        label=configuration.label,
                        acceptance=configuration.acceptance,
                        layout=configuration.layout,
                        tau=configuration.tau,
                        **comparison,
                    )
                )
            if batch > 1:  # the baseline: stock itself, each row decoded alone (other kernels, same math)
                alone = []
                for row in range(batch):
                    self.budget.check()
                    keep = inputs["attention_mask"][row].bool()
                    ids = inputs["input_ids"][row, keep][None]
                    output = generator.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
                    )
                    alone += new_tokens(output.sequences, ids.shape[1])
                comparison = compare_with_stock(stock_tokens, alone, stock_logits)
                self.result["exactness"].append(
                    dict(
                        record,
                        label="stock, each row alone",
                        acceptance=None,
                        layout=None,
                        tau=None,
                        **comparison,
                    )
                )
        finally:
            forcer.enabled = True

    # ---------------------------------------------------------------------------------- training
    def _training_items(self, shape: str) -> None:
        """sdpa, then flex_attention (CUDA), then the mask-gated LoRA's frozen-clean path against its
        two-stream path (MARS_SPEC §7): loss/gradient agreement and step time."""
        missing = _missing_modules(("trl", "datasets", "peft"))
        if missing:
            self.skip(f"{shape}: training", f"cannot import {', '.join(missing)}: {TRAINING_FIX}")
            return
        state: dict = {}
        estimate = None
        step = self.step_seconds.get((shape, 1))
        if step is not None:  # forward + backward of B x 2L tokens against one decoding step: a rough prior
            tokens = self.args.train_batch * 2 * self.args.train_length
            estimate = 5.0 + (self.args.train_repeats + 1) * step * max(3.0, tokens / 256)
        try:
            if not self._run_item(f"{shape}: train sdpa", estimate, self._train, shape, "sdpa", state):
                return
            sdpa_step = state["sdpa"]["step_seconds"]
            if self.device.type != "cuda":
                self.skip(f"{shape}: train flex_attention", FLEX_NEEDS_CUDA)
            else:
                estimate = PRIOR_FLEX_COMPILE_SECONDS + (self.args.train_repeats + 1) * 2 * sdpa_step
                if self._run_item(
                    f"{shape}: train flex_attention", estimate, self._train, shape, "flex_attention", state
                ):
                    self._agreement(shape, state, "flex_attention", "sdpa")
            state.pop("full", None)
            estimate = 5.0 + (self.args.train_repeats + 1) * 2 * sdpa_step
            for variant in ("gated frozen-clean", "gated two-stream"):
                if not self._run_item(
                    f"{shape}: train {variant}", estimate, self._train, shape, variant, state
                ):
                    return
            self._agreement(shape, state, "gated frozen-clean", "gated two-stream")
        finally:
            state.clear()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _trainer(self, shape: str, gated: bool):
        """A real `MARSTrainer` (its `compute_loss` is the loss under test) on a float32 copy of the shape."""
        import tempfile

        from datasets import Dataset

        from mars_hf.tools.synthetic import word_level_chat_tokenizer
        from mars_hf.training.config import MARSConfig
        from mars_hf.training.trainer import MARSTrainer

        model = build_model(shape, dtype=torch.float32, device=self.device, seed=self.args.seed + 7)
        mask_token_id = int(model.config.mars["mask_token_id"])
        # A word-level tokenizer whose <|mask|> sits at the shape's mask id (the trainer adds or finds the
        # mask token through the tokenizer and gates adapters to that id).
        words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        words += [f"w{i}" for i in range(len(words), mask_token_id)] + ["<|mask|>"]
        tokenizer = word_level_chat_tokenizer(words, "", mask_token="<|mask|>")
        dataset = Dataset.from_list([{"input_ids": [3, 4, 3, 4, 2]}, {"input_ids": [4, 3, 4, 3, 2]}])
        options = dict(
            output_dir=tempfile.mkdtemp(prefix="mars-gpu-check-"),
            block_size=self.args.window,
            report_to=[],
            bf16=False,
            fp16=False,
            use_cpu=self.device.type == "cpu",
            dataset_kwargs={"skip_prepare_dataset": True},
            remove_unused_columns=False,
            save_strategy="no",
        )
        peft_config = None
        if gated:
            from peft import LoraConfig

            options["adapter_gating"] = "mask"
            # The clean stream of a gated adapter is the base model: with tied embeddings (Qwen2.5-0.5B/1.5B)
            # its loss would still reach the mask row through the output matrix, so the frozen path needs
            # ar_weight = 0 (the trainer says so); both gated variants use it.
            options["ar_weight"] = 0.0
            peft_config = LoraConfig(
                r=16,
                lora_alpha=32,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                init_lora_weights=False,  # a non-zero delta, so that every adapter weight gets a gradient
            )
        trainer = MARSTrainer(
            model=model,
            args=MARSConfig(**options),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        if trainer.mask_token_id != mask_token_id:
            raise RuntimeError(
                f"MARSTrainer chose mask id {trainer.mask_token_id}, expected {mask_token_id}."
            )
        trainer.model.train()
        return trainer

    def _training_batch(self, model) -> dict:
        """``train_batch`` rows of ``train_length`` random tokens; the first quarter is unsupervised prompt,
        one row is shorter (right padding) so that the padding path runs."""
        args = self.args
        ordinary = ordinary_token_ids(model)
        generator = torch.Generator().manual_seed(args.seed + 11)
        shape = (args.train_batch, args.train_length)
        input_ids = ordinary[torch.randint(len(ordinary), shape, generator=generator)]
        attention_mask = torch.ones(shape, dtype=torch.long)
        if args.train_batch > 1:
            attention_mask[-1, -args.train_length // 8 :] = 0
            input_ids[-1, -args.train_length // 8 :] = model.config.pad_token_id
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, : args.train_length // 4] = -100
        batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return {k: v.to(self.device) for k, v in batch.items()}

    def _train(self, shape: str, variant: str, state: dict) -> None:
        """Forward + backward of one MARS batch through `MARSTrainer.compute_loss` (the first step compiles)."""
        gated = variant.startswith("gated")
        kind = "gated" if gated else "full"
        if kind not in state:
            trainer = self._trainer(shape, gated)
            state[kind] = (trainer, self._training_batch(trainer.model))
        trainer, batch = state[kind]
        model = trainer.model
        implementation = "sdpa" if gated else variant
        trainer.accelerator.unwrap_model(model).set_attn_implementation(implementation)
        if gated:
            trainer.args.frozen_clean_stream = None if variant == "gated frozen-clean" else False
        frozen_clean = bool(gated and trainer._use_frozen_clean(implementation))
        cuda = self.device.type == "cuda"
        times, first_seconds, loss_value, peak = [], None, None, None
        for repeat in range(self.args.train_repeats + 1):
            self.budget.check()
            model.zero_grad(set_to_none=True)
            _peak_memory_reset(self.device)
            if cuda:
                torch.cuda.synchronize()
            start = self.clock()
            loss = trainer.compute_loss(model, dict(batch))
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            seconds = self.clock() - start
            if repeat == 0:
                first_seconds = seconds
            else:
                times.append(seconds)
                peak = _peak_memory_mb(self.device)
            loss_value = float(loss.detach())
        gradients = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        state[variant] = {
            "loss": loss_value,
            "gradients": gradients,
            "step_seconds": statistics.median(times),
        }
        grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in gradients.values()))
        self.result["training"].append(
            {
                "model": shape,
                "variant": variant,
                "attn_implementation": implementation,
                "dtype": "float32",
                "batch": self.args.train_batch,
                "length": self.args.train_length,
                "block_size": self.args.window,
                "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "frozen_clean_stream": frozen_clean,
                "ar_weight": trainer.args.ar_weight,
                "loss": loss_value,
                "grad_norm": grad_norm,
                "first_step_seconds": first_seconds,
                "step_seconds": statistics.median(times),
                "step_seconds_all": times,
                "peak_memory_mb": peak,
            }
        )

    def _agreement(self, shape: str, state: dict, variant: str, reference_variant: str) -> None:
        candidate, reference = state.pop(variant), state.pop(reference_variant)
        max_abs = difference_sq = reference_sq = 0.0
        for name, expected in reference["gradients"].items():
            difference = (candidate["gradients"][name] - expected).double()
            max_abs = max(max_abs, float(difference.abs().max()))
            difference_sq += float(difference.pow(2).sum())
            reference_sq += float(expected.double().pow(2).sum())
        self.result["training"].append(
            {
                "model": shape,
                "comparison": f"{variant} vs {reference_variant}",
                "same_gradient_names": candidate["gradients"].keys() == reference["gradients"].keys(),
                "loss_abs_diff": abs(candidate["loss"] - reference["loss"]),
                "grad_max_abs_diff": max_abs,
                "grad_rel_diff": math.sqrt(difference_sq / max(reference_sq, 1e-300)),
                "step_time_ratio": candidate["step_seconds"] / reference["step_seconds"],
            }
        )


def compare_with_stock(stock_tokens, tokens, stock_logits, spacings: int = 4) -> dict:
    """Compare each row's tokens with stock greedy's (both cut after EOS).

    A differing row is judged at its first differing token ``t`` by stock's logit gap between its own
    token and the other run's there: within ``spacings`` bf16 spacings (2^(e - 7), e the exponent of
    stock's logit) it is a near-tie flip, which floating-point differences between kernels explain;
    a larger gap, or a run that merely stopped earlier or later, counts as another difference.
    """
    identical, flips, other, prefix = 0, [], [], []
    for row, (a, b) in enumerate(zip(stock_tokens, tokens)):
        length = min(len(a), len(b))
        first = next((t for t in range(length) if a[t] != b[t]), None)
        if first is None and len(a) == len(b):
            identical += 1
            prefix.append(1.0)
            continue
        first = length if first is None else first
        prefix.append(first / max(len(a), 1))
        if first >= length:
            other.append({"row": row, "position": first, "gap": None, "tie_tolerance": None})
            continue
        logits = stock_logits[row, first]
        gap = float(logits[a[first]] - logits[b[first]])
        magnitude = max(abs(float(logits[a[first]])), 1e-3)
        tolerance = spacings * 2.0 ** (math.floor(math.log2(magnitude)) - 7)
        entry = {"row": row, "position": first, "gap": gap, "tie_tolerance": tolerance}
        (flips if abs(gap) <= tolerance else other).append(entry)
    rows = len(stock_tokens)
    return {
        "rows": rows,
        "rows_identical": identical,
        "agreement": identical / max(rows, 1),
        "mean_agreeing_prefix": statistics.mean(prefix) if prefix else None,
        "near_tie_flips": len(flips),
        "other_differences": len(other),
        "differences": flips + other,
    }


def _missing_modules(names) -> list[str]:
    """Modules that cannot be imported, with the reason (a present but broken package counts too)."""
    import importlib

    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # ImportError, or a dependency's own failure (e.g. too old pyarrow)
            missing.append(f"{name} ({type(error).__name__}: {error})")
    return missing


def _planner_lines(result: dict) -> list[str]:
    """What the step planner chose (forwards by columns per row, choices per row-step) and the cost
    curve the decoder measured on this device, per model and batch (rows recorded by `bench.run_once`)."""
    lines = ["", "PLANNER (forwards by columns per row, width:count; choices per row-step; the measured curve)"]
    curves = {}
    for row in result["rows"]:
        if row["scheme"] == "stock" or not row.get("width_histogram"):
            continue
        widths, plans = planner_choices(row)
        lines.append(f"{row['model']:<13} {row['rate']:>4.2f} {row['batch']:>5} {row['label']:<24} {widths}; {plans}")
        if row.get("cost_curve"):
            curves.setdefault((row["model"], row["batch"]), row["cost_curve"])
    for (model, batch), curve in curves.items():
        points = ", ".join(f"{n}:{float(c):.2f}" for n, c in curve.items())
        lines.append(f"{model:<13} batch {batch}: cost curve (columns per row: relative cost) {points}")
    return lines


def run_gpu_check(
    args: GPUCheckArguments,
    budget_seconds: float,
    out: str | None = None,
    start: float | None = None,
    clock=time.monotonic,
) -> dict:
    """Run the check within ``budget_seconds`` counted from ``start`` (a ``clock()`` value, by default
    ``time.monotonic()``; default now); returns (and writes to ``out``) the JSON-able result. A replaced
    ``clock`` makes where the budget runs out independent of the machine (see `Budget`)."""
    return GPUCheck(args, budget_seconds, out, start, clock).run()


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"mars-hf gpu-check: {env['device']} ({env['device_name']}), torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['dtype']}, {result['budget']['elapsed_seconds']:.0f} s of a "
        f"{result['budget']['budget_seconds']:.0f} s budget, {env['date']}",
        "",
        "DECODING (random weights, forced acceptance; greedy; medians of interleaved repeats)",
    ]
    header = (
        f"{'model':<13} {'rate':>4} {'batch':>5} {'configuration':<24} {'tok/fwd':>7} {'pred.':>5} "
        f"{'tok/s':>8} {'speedup':>7} {'effic.':>6} {'=stock':>6} {'drafts':>6} {'peak MiB':>8}"
    )
    lines += [header, "-" * len(header)]
    previous = None
    for row in result["rows"]:
        key = (row["model"], row["rate"], row["batch"])
        if previous is not None and key != previous:
            lines.append("")
        previous = key
        lines.append(
            f"{row['model']:<13} {row['rate']:>4.2f} {row['batch']:>5} {row['label']:<24} "
            f"{row['tokens_per_forward']:>7.2f} {_fmt(row['predicted_tokens_per_forward'], '.2f'):>5} "
            f"{row['tokens_per_s']:>8.1f} {row['speedup']:>6.2f}x {row['efficiency']:>6.2f} "
            f"{row['same_as_stock']:>6.2f} {_fmt(row.get('draft_acceptance'), '.2f'):>6} "
            f"{_fmt(row['peak_memory_mb'], '.0f'):>8}"
        )
    lines += [
        "tok/fwd = generated / (batch x forwards, the prompt's included); pred. = what the forced pattern "
        "implies (exact for cursor/none); speedup = tokens/s vs stock generate; effic. = speedup / "
        "(tok/fwd / stock tok/fwd), the MARS_SPEC §4 cost factor; =stock = share of rows equal to stock; "
        "drafts = verify's accepted / proposed drafts.",
    ]
    lines += _planner_lines(result)
    lines += ["", "EXACTNESS (unforced random model, greedy, vs stock generate)"]
    for row in result["exactness"]:
        lines.append(
            f"{row['model']:<13} batch {row['batch']:>2} {row['label']:<24} identical rows {row['rows_identical']}/"
            f"{row['rows']}, near-tie flips {row['near_tie_flips']}, other differences {row['other_differences']}, "
            f"mean agreeing prefix {_fmt(row['mean_agreeing_prefix'], '.2f')}"
        )
    lines += ["", "TRAINING (one MARS step through MARSTrainer.compute_loss, forward + backward, float32)"]
    for row in result["training"]:
        if "comparison" in row:
            lines.append(
                f"{row['model']:<13} {row['comparison']}: loss diff {row['loss_abs_diff']:.2e}, grad max abs "
                f"diff {row['grad_max_abs_diff']:.2e}, grad rel diff {row['grad_rel_diff']:.2e}, "
                f"time ratio {row['step_time_ratio']:.2f}"
            )
        else:
            lines.append(
                f"{row['model']:<13} {row['variant']:<18} loss {row['loss']:.4f}, step "
                f"{row['step_seconds'] * 1000:.1f} ms (first, with compilation: {row['first_step_seconds']:.2f} s), peak "
                f"{_fmt(row['peak_memory_mb'], '.0f')} MiB"
            )
    lines += ["", f"SKIPPED ({len(result['skipped'])})"]
    lines += [f"  {entry['item']}: {entry['reason']}" for entry in result["skipped"]]
    errors = [item for item in result["items"] if item["status"] == "error"]
    if errors:
        lines += ["", f"ERRORS ({len(errors)})"]
        lines += [f"  {item['item']}: {item['error']}" for item in errors]
    if result["budget"]["stopped"]:
        lines.append(f"stopped: {result['budget']['stopped']}")
    return "\n".join(lines)


__all__ = [
    "GPUCheckArguments",
    "ForcedAcceptance",
    "build_model",
    "format_table",
    "run_gpu_check",
    "tiny_arguments",
]
