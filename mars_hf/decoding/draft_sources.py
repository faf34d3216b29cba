"""Draft sources other than the masks, for verified decoding (docs/method.md §5, §6).

Verified decoding keeps a draft only if it is the model's own choice, so any proposal is safe; a
source only changes how many tokens a forward yields. ``lookup_drafts`` is prompt lookup with
transformers' meaning (``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``, its
``PromptLookupCandidateGenerator``): the continuation of the first earlier occurrence of the row's
last n-gram (n from the largest down to 1), cut before an EOS. It is deterministic; a sampled row keeps
a lookup draft where it equals the row's keyed draw there (``sampling.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

LOOKUP = "lookup"  # the prompt-lookup source's name in statistics (``MARSGenerateOutput``, serving usage)
MASKS = "masks"  # the masks' own drafts
ASSISTANT = "assistant"  # a separate draft model's (``assistant_model=``, docs/method.md §5)
# the masks' drafts with the draft model's continuation after them (the draft model reads the row's
# tokens and the mask drafts; docs/method.md §5): one chain, checked left to right like any other
CHAINED = "masks+assistant"
SOURCES = (MASKS, LOOKUP, ASSISTANT, CHAINED)
DEFAULT_MAX_NGRAM = 2  # transformers' default ``max_matching_ngram_size``


def lookup_drafts(
    tokens: Sequence[int],
    num_tokens: int,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    eos_token_ids: Collection[int] = (),
) -> list[int]:
    """Up to ``num_tokens`` tokens that followed an earlier occurrence of the last n-gram of ``tokens``.

    As transformers: n from ``min(max_ngram, len(tokens) - 1)`` down to 1; for each n the leftmost
    occurrence with at least one token after it wins (the trailing n-gram itself never does); the
    continuation stops at the end of ``tokens`` and is cut before its first EOS (possibly to nothing,
    and then no shorter n-gram is tried). ``[]`` when nothing matches.
    """
    if num_tokens <= 0 or max_ngram <= 0:
        raise ValueError(
            f"prompt lookup needs `prompt_lookup_num_tokens` >= 1 and `max_matching_ngram_size` >= 1, "
            f"got {num_tokens} and {max_ngram}."
        )
    length = len(tokens)
    for size in range(min(max_ngram, length - 1), 0, -1):
        tail = list(tokens[length - size :])
        first = tail[0]
        for start in range(length - size):  # start + size < length: at least one token follows
            if tokens[start] == first and list(tokens[start : start + size]) == tail:
                chosen = list(tokens[start + size : min(start + size + num_tokens, length)])
                for j, token in enumerate(chosen):
                    if token in eos_token_ids:
                        return chosen[:j]
                return chosen
    return []
