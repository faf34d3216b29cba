"""Tokens per forward pass of a decoding run: how many tokens each model call produced on average."""

import datasets
import evaluate

_DESCRIPTION = """
Tokens per forward = (sum of generated tokens) / (sum of model forward passes), over all examples
(a micro-average, so long generations weigh by their length). Stock autoregressive decoding scores
exactly 1.0: every forward pass, the prompt's included, yields one token. Every model call counts,
the prefill included. Also returns the macro-average over examples and the totals.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: number of generated tokens per example.
    references: number of forward passes spent on each example.
Returns:
    dict with ``tokens_per_forward`` (micro), ``mean_tokens_per_forward`` (macro), ``num_tokens`` and
    ``num_forwards``.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class TokensPerForward(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        if len(predictions) == 0:
            raise ValueError("tokens_per_forward needs at least one example.")
        if any(forwards < 1 for forwards in references):
            raise ValueError("Every example needs at least one forward pass (references >= 1).")
        num_tokens, num_forwards = int(sum(predictions)), int(sum(references))
        return {
            "tokens_per_forward": num_tokens / num_forwards,
            "mean_tokens_per_forward": sum(t / f for t, f in zip(predictions, references)) / len(predictions),
            "num_tokens": num_tokens,
            "num_forwards": num_forwards,
        }
