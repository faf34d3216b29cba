"""pass@k of code completions, each run against its tests in a separate Python process.

Offline counterpart of the Hub's ``code_eval``: execution goes through
:func:`mars_hf.evaluation.code_execution.run_program` (a limited subprocess per candidate: resource limits, private
temporary folder, no network where the machine allows it), never in this process.
"""

import datasets
import evaluate
import numpy as np

from mars_hf.evaluation.code_execution import active_guards, run_program

_DESCRIPTION = """
Runs every candidate program (prompt + completion + test code, already concatenated) in its own
Python subprocess and reports the unbiased pass@k estimator of Chen et al. (2021):
pass@k = mean over problems of 1 - C(n - c, k) / C(n, k), with n candidates and c passing.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: per problem, a list of complete candidate programs (strings) that exit with status 0
        when their tests pass.
    references: per problem, an identifier (e.g. the HumanEval task id), echoed in ``results``.
    k: list of k values (default [1]).
    timeout: seconds each program may run (default 10).
    memory_mb: address-space limit of each program (default 2048).
Returns:
    dict with ``pass@k`` for each k, ``results``: per problem, a list of (passed, status) pairs, and
    ``guards``: which isolation guards were active (see ``mars_hf.evaluation.code_execution.active_guards``).
"""


def pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class CodePassAtK(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("string")),
                    "references": datasets.Value("string"),
                }
            ),
        )

    def _compute(self, predictions, references, k=(1,), timeout=10.0, memory_mb=2048):
        scores = {f"pass@{kk}": [] for kk in k}
        results = {}
        for candidates, reference in zip(predictions, references):
            outcomes = [run_program(program, timeout=timeout, memory_mb=memory_mb) for program in candidates]
            results[reference] = [(outcome.passed, outcome.status) for outcome in outcomes]
            correct = sum(outcome.passed for outcome in outcomes)
            for kk in k:
                if len(candidates) >= kk:
                    scores[f"pass@{kk}"].append(pass_at_k(len(candidates), correct, kk))
        output = {name: float(np.mean(values)) for name, values in scores.items() if values}
        output["results"] = results
        output["guards"] = active_guards()
        return output
