"""The run: the plan in priority order, each item estimated, run within the budget and recorded.

The sections (`decoding`, `exactness`, `training`) are functions of the running `GPUCheck`: they read its
arguments, device, clock, budget, models and estimates, and write into its result through `run_item`,
`skip` and ``result``.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
import traceback
from dataclasses import asdict
from functools import partial

import torch

from mars_hf.tools.bench import greedy_generation_config
from mars_hf.tools.gpu_check.arguments import GPUCheckArguments
from mars_hf.tools.gpu_check.budget import Budget, BudgetExceeded
from mars_hf.tools.gpu_check.decoding import decode_item
from mars_hf.tools.gpu_check.estimates import CostEstimates
from mars_hf.tools.gpu_check.exactness import exactness_item
from mars_hf.tools.gpu_check.forced_acceptance import ForcedAcceptance
from mars_hf.tools.gpu_check.generation import SynchronizedGenerate
from mars_hf.tools.gpu_check.machine import environment, max_rss_mb
from mars_hf.tools.gpu_check.random_models import MODEL_SHAPES, build_model, make_prompts
from mars_hf.tools.gpu_check.training import training_items

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
PROBE_TOKENS = 8  # new tokens of the probe's short generations


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
        self.estimates = CostEstimates(args, self.device.type)
        self.out = out
        self.models: dict = {}  # shape -> {"model", "forcer"} while that shape's items run
        self.result = {
            "schema_version": SCHEMA_VERSION,
            "environment": environment(self.device, args.dtype),
            "arguments": asdict(args),
            "budget": {"budget_seconds": float(budget_seconds), "elapsed_seconds": 0.0, "stopped": None},
            "models": {},
            "rows": [],
            "exactness": [],
            "training": [],
            "skipped": [],
            "items": [],
        }

    # ------------------------------------------------------------------------------ record keeping
    def write(self) -> None:
        """Rewrite the JSON (atomically), so that a killed run still leaves what it measured."""
        self.result["budget"]["elapsed_seconds"] = round(self.budget.elapsed(), 2)
        self.result["environment"]["max_rss_mb"] = max_rss_mb()
        if self.out:
            tmp = self.out + ".tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(self.result, handle, indent=1)
            os.replace(tmp, self.out)

    def skip(self, item: str, reason: str) -> None:
        logger.warning("gpu-check: skipping %s: %s", item, reason)
        self.result["skipped"].append({"item": item, "reason": reason})

    def run_item(self, item: str, estimate: float | None, function, *args) -> bool:
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
            record["status"] = "error"
            record["error"] = f"{type(error).__name__}: {error}"
            record["traceback"] = traceback.format_exc(limit=8)
            logger.error("gpu-check: %s failed:\n%s", item, record["traceback"])
        finally:
            self.budget.disarm()
            record["seconds"] = round(self.clock() - start, 3)
            self.result["items"].append(record)
            self.write()
        logger.info(
            "gpu-check [%5.0f s / %.0f s] %s: %s in %.1f s",
            self.budget.elapsed(),
            self.budget.seconds,
            item,
            record["status"],
            record["seconds"],
        )
        return record["status"] == "ran"

    # ------------------------------------------------------------------------------------ the plan
    def run(self) -> dict:
        self.args.validate()
        self.write()
        for index, shape in enumerate(self.args.models):
            plan = self.plan(shape, index)
            if not self.run_item(f"{shape}: build", self.estimates.build(shape), self.build, shape):
                for name, _ in plan:
                    self.skip(name, f"not run: the {shape} model was not built")
                continue
            self.run_item(f"{shape}: probe", None, self.probe, shape)
            for _, runner in plan:
                runner()
            self.release(shape)
        self.write()
        return self.result

    def plan(self, shape: str, index: int) -> list:
        """``(name, runner)`` of one model's item groups in priority order: the first (paper-like) rate at
        the first two batch sizes; exactness (first model only) and training, the paths no CPU test
        reaches; the first rate at the other batch sizes; then the other rates."""
        args = self.args
        decode = "decode" in args.parts
        first, rest = list(args.rates[:1]), list(args.rates[1:])
        batches = list(args.batch_sizes)

        def decoding(rates, batch_sizes):
            return [
                (f"{shape}: decode rate={rate:g} batch={b}", partial(decode_item, self, shape, rate, b))
                for rate in (rates if decode else [])
                for b in batch_sizes
            ]

        plan = decoding(first, batches[:2])
        if index == 0 and "exactness" in args.parts:
            plan.append((f"{shape}: exactness", partial(exactness_item, self, shape)))
        if shape in args.models[: args.train_models] and "training" in args.parts:
            plan.append((f"{shape}: training", partial(training_items, self, shape)))
        return plan + decoding(first, batches[2:]) + decoding(rest, batches)

    def release(self, shape: str) -> None:
        entry = self.models.pop(shape, None)
        if entry is not None:
            entry["forcer"].remove()
        del entry
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------- build + probe
    def build(self, shape: str) -> None:
        start = self.clock()
        model = build_model(shape, dtype=self.dtype, device=self.device, seed=self.args.seed)
        forcer = ForcedAcceptance(model, self.args.rates[0], seed=self.args.seed)
        seconds = self.clock() - start
        self.models[shape] = {"model": model, "forcer": forcer}
        self.result["models"][shape] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "config": dict(MODEL_SHAPES[shape]),
            "dtype": self.args.dtype,
            "build_seconds": round(seconds, 3),
        }

    def probe(self, shape: str) -> None:
        """Seconds per stock forward at each batch size (a short greedy generation, after a warm-up)."""
        model = self.models[shape]["model"]
        generator = SynchronizedGenerate(model)
        config = greedy_generation_config(model, PROBE_TOKENS)
        for batch in sorted(set(self.args.batch_sizes) | set(self.args.exactness_batch_sizes)):
            inputs = make_prompts(model, batch, self.args.prompt_length, self.args.seed, self.device)
            generator.generate(**inputs, generation_config=config)  # warm-up
            start = self.clock()
            generator.generate(**inputs, generation_config=config)
            self.estimates.step_seconds[(shape, batch)] = (self.clock() - start) / PROBE_TOKENS
            self.budget.check()
        self.result["models"][shape]["stock_step_seconds"] = self.estimates.stock_steps(shape)


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
