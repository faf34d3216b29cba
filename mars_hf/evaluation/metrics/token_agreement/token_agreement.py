"""Token agreement between generated token sequences and reference ones (e.g. the base model's greedy output).

Used to check that decoding with MARS, or a MARS-trained model, still says what the base model says.
"""

import datasets
import evaluate

_DESCRIPTION = """
Position-wise agreement of token-id sequences with reference sequences.

* ``agreement``: matching positions / max(len(prediction), len(reference)), summed over all examples
  (a missing or extra token counts as a mismatch, so a shorter or longer output cannot score 1.0);
* ``exact_match``: fraction of predictions identical to their reference;
* ``prefix_agreement``: mean over examples of (common-prefix length / reference length), i.e. how
  far the output follows the reference before the first divergence.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of token-id lists.
    references: list of token-id lists, one per prediction.
Returns:
    dict with ``agreement``, ``exact_match`` and ``prefix_agreement`` in [0, 1].
Example:
    >>> metric = evaluate.load("mars_hf/evaluation/metrics/token_agreement")
    >>> metric.compute(predictions=[[1, 2, 3]], references=[[1, 2, 4]])["agreement"]
    0.6666666666666666
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class TokenAgreement(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int64")),
                    "references": datasets.Sequence(datasets.Value("int64")),
                }
            ),
        )

    def _compute(self, predictions, references):
        if len(predictions) == 0:
            raise ValueError("token_agreement needs at least one prediction.")
        matched = total = exact = 0
        prefix_fractions = []
        for prediction, reference in zip(predictions, references):
            prediction, reference = list(prediction), list(reference)
            same = sum(a == b for a, b in zip(prediction, reference))
            matched += same
            total += max(len(prediction), len(reference))
            exact += prediction == reference
            prefix = 0
            for a, b in zip(prediction, reference):
                if a != b:
                    break
                prefix += 1
            prefix_fractions.append(prefix / len(reference) if reference else float(not prediction))
        return {
            "agreement": matched / total if total else 1.0,
            "exact_match": exact / len(predictions),
            "prefix_agreement": sum(prefix_fractions) / len(prefix_fractions),
        }
