"""Dataset screening for `MARSTrainer`: rows that can teach MARS nothing are counted, reported and dropped.

A row teaches MARS only through a supervised label past its first position (a MARS target). Raw rows
(prompt/completion, messages, text) are screened before TRL tokenizes them; tokenized rows after, which
also catches what truncation at ``max_length`` cut away. A split with no row left is refused by name.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

from datasets import Dataset

logger = logging.getLogger(__name__)


def has_supervised_target(dataset, limit: int | None = None) -> bool:
    """True if some example has a supervised label at position >= 1 (a MARS target)."""
    for index, example in enumerate(dataset):
        if limit is not None and index >= limit:
            return True  # an iterable dataset: cannot look at everything, trust the rest
        labels = example.get("labels", example.get("input_ids"))
        if labels is not None and any(label != -100 for label in list(labels)[1:]):
            return True
    return False


# ---- Dataset screening: rows that can teach MARS nothing are counted, reported and dropped before training.
# Each reason is a phrase completing "N rows ...".
_EMPTY_COMPLETION = "with an empty completion"
_NO_ASSISTANT_TURN = "with no assistant turn"
_EMPTY_ASSISTANT_TURN = "whose assistant turns are all empty"
_EMPTY_TEXT = "with empty text"
NO_TARGET = "with no supervised token past the first position"


def _blank(content) -> bool:
    """Whether a message content (a string or a list of typed parts) holds no text and nothing else."""
    if content is None:
        return True
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, (list, tuple)):
        return all(
            isinstance(part, dict)
            and part.get("type", "text") == "text"
            and not str(part.get("text") or "").strip()
            for part in content
        )
    return False


def _blank_message(message) -> bool:
    return not isinstance(message, dict) or (_blank(message.get("content")) and not message.get("tool_calls"))


def _raw_row_problem(example: dict, text_field: str) -> str | None:
    """Why an untokenized row (prompt/completion, messages or text) can teach MARS nothing, or None."""
    if "prompt" in example and "completion" in example:
        completion = example["completion"]
        if isinstance(completion, str):
            return _EMPTY_COMPLETION if not completion.strip() else None
        if completion is None or (
            isinstance(completion, list) and all(_blank_message(m) for m in completion)
        ):
            return _EMPTY_COMPLETION
        return None
    if "messages" in example:
        assistant = [
            m for m in example["messages"] or [] if isinstance(m, dict) and m.get("role") == "assistant"
        ]
        if not assistant:
            return _NO_ASSISTANT_TURN
        return _EMPTY_ASSISTANT_TURN if all(_blank_message(m) for m in assistant) else None
    text = example.get(text_field)
    return _EMPTY_TEXT if isinstance(text, str) and not text.strip() else None


def _column_rows(dataset, columns: list[str]):
    """The rows of a `datasets.Dataset` restricted to ``columns``, read column-wise (much faster than by row)."""
    return (dict(zip(columns, values)) for values in zip(*(dataset[column] for column in columns)))


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in counts.items())


def check_not_empty(split: str, dataset) -> None:
    """Refuse an empty dataset before TRL reads its first row (which raises a bare StopIteration)."""
    if hasattr(dataset, "__len__"):
        empty = len(dataset) == 0
    else:
        empty = next(iter(dataset), None) is None
    if empty:
        raise ValueError(
            f"The {split} dataset is empty (0 rows): MARS has nothing to learn from. Pass a dataset with at least "
            "one example (columns 'messages', 'prompt'/'completion', 'text', or tokenized 'input_ids')."
        )


ROW_FORMATS = (
    "'messages' (a chat), 'prompt' and 'completion', '{text}' (plain text, `dataset_text_field`), "
    "'conversations' (from/value turns) or tokenized 'input_ids'"
)


def _row_format(row: dict, text_field: str) -> str | None:
    """The format TRL reads a row in (a column a row lacks reads as None), or None for none of them."""
    for name in ("input_ids", "messages", "conversations"):
        if row.get(name) is not None:
            return name
    if row.get("prompt") is not None and row.get("completion") is not None:
        return "prompt/completion"
    return text_field if isinstance(row.get(text_field), str) else None


def check_row_formats(dataset, text_field: str, source: str) -> None:
    """Refuse the first row of ``dataset`` in none of TRL's formats, naming ``source`` (a file, a split), the
    row and the formats; TRL would fail on it with a bare ``KeyError: 'text'`` in the middle of tokenizing.

    Rows of several formats are refused too: TRL reads a dataset in the format of its columns, so a file of 5
    ``text`` rows and 1 ``messages`` row trained on the one chat alone, without a word.

    A `datasets.Dataset` is read column-wise, every row; other datasets are left to TRL.
    """
    if not isinstance(dataset, Dataset):
        return
    names = ("input_ids", "messages", "conversations", "prompt", "completion", text_field)
    columns = [c for c in dict.fromkeys(names) if c in dataset.column_names]
    rows = _column_rows(dataset, columns) if columns else ({} for _ in range(len(dataset)))
    formats: dict[str, list[int]] = {}  # format -> its rows
    for index, row in enumerate(rows):
        found = _row_format(row, text_field)
        if found is None:
            values = dataset[index]
            fields = sorted(k for k, v in values.items() if v is not None)
            # a file's rows share their columns: a null value and a field the row lacks both read as None
            empty = sorted(k for k, v in values.items() if v is None and k in names)
            nulls = f"; null or absent: {empty}" if empty else ""
            raise ValueError(
                f"Row {index} of {source} has none of the training formats (its fields: {fields}{nulls}). Each "
                f"row needs one of: {ROW_FORMATS.format(text=text_field)}."
            )
        formats.setdefault(found, []).append(index)
    if len(formats) > 1:
        counts = ", ".join(f"{len(rows)} '{name}' (first: row {rows[0]})" for name, rows in formats.items())
        raise ValueError(
            f"{source} mixes training formats: {counts} rows. TRL reads a dataset in one format, so the other "
            "rows would be dropped or misread; convert them to one format (or train on each file alone)."
        )


def refuse_if_nothing_left(split: str, total: int, counts: dict[str, int], max_length: int | None) -> None:
    if total == 0 or sum(counts.values()) < total:
        return
    raise ValueError(
        f"The {split} dataset has no row MARS can learn from: of its {total} rows, {_describe(counts)}. A row "
        "teaches MARS only through a supervised token past its first position. Check that completions and "
        "assistant turns are not empty, `completion_only_loss` / "
        "`assistant_only_loss` (an assistant-only loss needs a chat template with {% generation %} markers), "
        f"that `max_length` ({max_length}) does not cut every response away, and that a provided 'labels' "
        "column is not all -100."
    )


def screen_raw(
    split: str, dataset, text_field: str, formatting_func
) -> tuple[Any, int | None, dict[str, int]]:
    """Refuse an empty dataset; count and drop untokenized rows with nothing to supervise (before TRL sees them).

    Returns the dataset to hand to TRL, its row count as given (None when unsized) and the drop counts.
    """
    check_not_empty(split, dataset)
    total = len(dataset) if hasattr(dataset, "__len__") else None
    if not isinstance(dataset, Dataset) or formatting_func is not None:
        return dataset, total, {}
    check_row_formats(dataset, text_field, source=f"the {split} dataset")
    columns = [c for c in ("prompt", "completion", "messages", text_field) if c in dataset.column_names]
    if "input_ids" in dataset.column_names or not columns:
        return dataset, total, {}
    problems = [_raw_row_problem(row, text_field) for row in _column_rows(dataset, columns)]
    counts = Counter(problem for problem in problems if problem)
    if counts:
        dataset = dataset.select([i for i, problem in enumerate(problems) if problem is None])
    return dataset, total, dict(counts)


def warn_dropped(split: str, total: int, counts: dict[str, int]) -> None:
    dropped = sum(counts.values())
    if dropped:
        logger.warning(
            "MARSTrainer dropped %d of %d %s rows that MARS cannot learn from: %s; %d remain.",
            dropped,
            total,
            split,
            _describe(counts),
            total - dropped,
        )


def screen_raw_splits(train_dataset, eval_dataset, text_field: str, formatting_func, max_length: int | None):
    """`screen_raw` on the train split and every eval split; refuse a split with no row left.

    Returns ``(train_dataset, eval_dataset, screened)``, ``screened`` mapping each split to its row count as
    given and its drop counts (what `screen_prepared` adds to after tokenization).
    """
    screened = {}
    if train_dataset is not None:
        train_dataset, *screened["train"] = screen_raw("train", train_dataset, text_field, formatting_func)
    if isinstance(eval_dataset, dict):
        eval_dataset = dict(eval_dataset)
        for name in eval_dataset:
            eval_dataset[name], *screened[name] = screen_raw(
                name, eval_dataset[name], text_field, formatting_func
            )
    elif eval_dataset is not None:
        eval_dataset, *screened["eval"] = screen_raw("eval", eval_dataset, text_field, formatting_func)
    for split, (total, counts) in screened.items():
        refuse_if_nothing_left(split, total or 0, counts, max_length)
    return train_dataset, eval_dataset, screened


def screen_prepared(split: str, dataset, screened, row_problems, max_length: int | None):
    """Count and drop tokenized rows without a MARS target; refuse the split when none is left, else warn.

    ``screened`` is `screen_raw`'s ``(total, counts)`` for the split (None when it was not screened raw);
    ``row_problems(dataset)`` gives per row why it teaches nothing, or None. Besides rows tokenized without
    a target, this counts the rows TRL's own truncation step dropped (silently). Returns the dataset to use.
    """
    if not isinstance(dataset, Dataset):  # streamed: look at the first rows only
        if not has_supervised_target(dataset, limit=1000 if not hasattr(dataset, "__len__") else None):
            refuse_if_nothing_left(split, 1, {NO_TARGET: 1}, max_length)
        return dataset
    total, counts = screened if screened is not None else (len(dataset), {})
    counts = dict(counts)
    lost = total - sum(counts.values()) - len(dataset)  # TRL drops rows truncation left fully masked
    if lost > 0:
        counts[f"cut to no supervised token by truncation at max_length={max_length}"] = lost
    problems = row_problems(dataset)
    for problem in problems:
        if problem:
            counts[problem] = counts.get(problem, 0) + 1
    refuse_if_nothing_left(split, total, counts, max_length)
    warn_dropped(split, total, counts)
    if any(problems):
        dataset = dataset.select([i for i, problem in enumerate(problems) if problem is None])
    return dataset


def prepared_row_problems(dataset, processing_class, args, chat_template=None) -> list[str | None]:
    """Per tokenized row, why it teaches MARS nothing (no target; chat cut to its prompt), or None.

    `messages` rows that truncation at ``args.max_length`` left with prompt tokens only are caught here:
    TRL keeps those, since every token of a chat is supervised unless ``assistant_only_loss``.
    """
    columns = dataset.column_names
    label_column = "labels" if "labels" in columns else "input_ids"
    check_chat = "messages" in columns and args.max_length is not None and not args.assistant_only_loss
    extra = [c for c in ("messages", "tools", "chat_template_kwargs") if check_chat and c in columns]
    problems = []
    for row in _column_rows(dataset, [label_column, *extra]):
        labels = list(row[label_column] or [])
        if not any(label != -100 for label in labels[1:]):
            problems.append(NO_TARGET)
        elif (
            check_chat
            and len(labels) >= args.max_length
            and assistant_cut_away(row, processing_class, args, chat_template)
        ):
            problems.append(f"cut to prompt tokens only by truncation at max_length={args.max_length}")
        else:
            problems.append(None)
    return problems


def assistant_cut_away(row: dict, processing_class, args, chat_template=None) -> bool:
    """Whether truncation at ``args.max_length`` removed every assistant token of a `messages` row."""
    messages = row["messages"]
    roles = [message.get("role") for message in messages]
    if "assistant" not in roles:
        return False
    tools = row.get("tools")
    kwargs = {
        "chat_template": chat_template,
        "tools": json.loads(tools) if isinstance(tools, str) else tools,
        **(row.get("chat_template_kwargs") or {}),
    }

    def length(part, add_generation_prompt=False):
        if not part:
            return 0
        out = processing_class.apply_chat_template(
            part, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return len(out["input_ids"])

    max_length = args.max_length
    if args.truncation_mode == "keep_end":  # the kept window starts at total - max_length
        last = len(roles) - 1 - roles[::-1].index("assistant")
        return length(messages) - max_length >= length(messages[: last + 1])
    return length(messages[: roles.index("assistant")], add_generation_prompt=True) >= max_length
