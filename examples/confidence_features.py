"""Would a richer confidence than the mask's top probability rank the masks better? (docs/embedded_mars.md)

τ's calibration maps the top probability monotonically per mask offset, so it only moves τ along one fixed
curve of tokens per forward against agreement with the model; a better *ranking* of the masks would move the
curve itself. This script measures that ranking on held-out answers. Every usable mask prediction (teacher
forced, the conditional ones the calibration fit uses: a mask counts only while the masks before it in its
step were right) gets features decoding has for free: its top probability, its margin to the second, its
entropy, and the real row's own confidence in the token just before the masks. Logistic regressions on
feature sets are fitted on ``--fit-data`` and scored on ``--test-data``: AUC, and the share of masks that can
be accepted at a given precision.

    python examples/confidence_features.py --model embedded-mars \\
        --fit-data data/embedded-mars/calibration.jsonl --test-data data/embedded-mars/curve.jsonl
"""

from __future__ import annotations

import argparse
import math

import torch

FEATURE_SETS = (("top",), ("top", "margin"), ("top", "before"), ("top", "margin", "entropy", "before"))
PRECISIONS = (0.99, 0.97, 0.95, 0.9)


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


@torch.no_grad()
def mask_samples(model, tokenizer, path: str, block_size: int, mask_token_id: int) -> list[dict]:
    """Per usable mask prediction: its offset, features and whether it is the model's own token."""
    from mars_hf.evaluation.runs import teacher_forced_forward
    from mars_hf.training.calibration_fit import examples_from_records, read_jsonl, usable_mask_predictions

    samples = []
    for ids, labels in zip(*examples_from_records(tokenizer, read_jsonl(path))):
        tokens, labels_t, logits, length = teacher_forced_forward(
            model, ids, labels, block_size=block_size, mask_token_id=mask_token_id
        )
        logits[:, mask_token_id] = float("-inf")  # decoding never emits the mask token
        probs = logits.softmax(-1)
        top2 = probs.topk(2, dim=-1)
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
        top, prediction = top2.values[:, 0].tolist(), top2.indices[:, 0].tolist()
        second, entropy = top2.values[:, 1].tolist(), entropy.tolist()
        usable = usable_mask_predictions(
            tokens.tolist(), (labels_t != -100).tolist(), prediction, length, block_size, conditional=True
        )
        for offset, p, right in usable:
            q = length + p  # the mask's logit row
            start = p - offset + 1  # the step's first mask position; the real row before it is start - 1
            samples.append(
                {
                    "offset": offset,
                    "right": float(right),
                    "top": _logit(top[q]),
                    "margin": math.log(max(top[q] - second[q], 1e-6)),
                    "entropy": entropy[q],
                    "before": _logit(top[start - 1]),
                }
            )
    return samples


def fit_logistic(samples: list[dict], names):
    """A standardised logistic regression on ``names`` (LBFGS); returns a scorer for other samples."""
    x = torch.tensor([[s[n] for n in names] for s in samples], dtype=torch.float64)
    y = torch.tensor([s["right"] for s in samples], dtype=torch.float64)
    mean, std = x.mean(0), x.std(0) + 1e-9
    w = torch.zeros(len(names), dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=200)

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits((x - mean) / std @ w + b, y)
        loss.backward()
        return loss

    optimizer.step(closure)

    def score(rows: list[dict]) -> torch.Tensor:
        features = torch.tensor([[s[n] for n in names] for s in rows], dtype=torch.float64)
        return ((features - mean) / std @ w + b).detach()

    return score


def ranking_report(scores: torch.Tensor, right: torch.Tensor) -> dict:
    """AUC, and per precision the largest share of masks, taken best-scored first, that keeps it."""
    positive, negative = scores[right == 1], scores[right == 0]
    auc = (positive[:, None] > negative[None, :]).double().mean().item()
    ranked = right[scores.argsort(descending=True)]
    running = ranked.cumsum(0) / torch.arange(1, len(ranked) + 1)
    coverage = {}
    for precision in PRECISIONS:
        kept = (running >= precision).nonzero()
        coverage[precision] = (kept.max().item() + 1) / len(ranked) if len(kept) else 0.0
    return {"auc": auc, "coverage": coverage}


def main() -> None:
    from transformers import AutoTokenizer

    from mars_hf import AutoMARSModelForCausalLM
    from mars_hf.evaluation.runs import mars_block
    from mars_hf.models.embedded_model import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded-mars")
    parser.add_argument("--fit-data", required=True, help="JSONL of self-distilled answers to fit on.")
    parser.add_argument("--test-data", required=True, help="JSONL of other answers to score on.")
    args = parser.parse_args()
    model = AutoMARSModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    block_size, mask_token_id = mars_block(model, None, None)
    fit = mask_samples(model, tokenizer, args.fit_data, block_size, mask_token_id)
    test = mask_samples(model, tokenizer, args.test_data, block_size, mask_token_id)
    for offset in range(1, block_size + 1):
        fit_rows = [s for s in fit if s["offset"] == offset]
        test_rows = [s for s in test if s["offset"] == offset]
        right = torch.tensor([s["right"] for s in test_rows], dtype=torch.float64)
        print(f"mask offset {offset}: fit on {len(fit_rows)}, scored on {len(test_rows)} (right: {right.mean():.3f})")
        for names in FEATURE_SETS:
            report = ranking_report(fit_logistic(fit_rows, names)(test_rows), right)
            shares = ", ".join(f"{share:.3f} at ≥ {p}" for p, share in report["coverage"].items())
            print(f"  {' + '.join(names):30} AUC {report['auc']:.4f}; share kept {shares}")


if __name__ == "__main__":
    main()
