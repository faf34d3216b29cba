"""Drafts for verified decoding: where they come from and what they are worth (docs/method.md §5, §6).

A draft is a token proposed for a position after a row's last token; the next forward checks it, and
verification keeps it only where it is the model's own choice (its argmax, or a sampled row's keyed
draw, ``sampling.py``). So any proposal is safe: a source only changes how many tokens a forward yields.

- ``Drafts``: an immutable chain of proposed tokens, with the source that made it. The decoder holds a
  row's drafts; nothing else changes them.
- ``DraftSource``: anything that proposes ``Drafts`` for rows (as transformers' candidate generators and
  vLLM's proposers do). Three ship: ``MaskDrafts`` (the mask predictions of the forward just run),
  ``PromptLookup`` (transformers' prompt lookup) and ``AssistantDrafts`` (a separate draft model).
- ``DraftChooser``: each step, before the planner sizes the feed, offers each row the chain worth most
  net of what checking it costs on the measured curve: the masks' drafts in hand, prompt lookup's, a
  draft model's continuation of the row (*plain*) or of the row and its first mask drafts (*chained*).
  Values come from each source's observed acceptance (``stats.py``) and the masks' calibrated confidences.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.generation.logits_process import LogitsProcessorList

from .rules import proposal_count
from .sampling import KeyedNoiseProcessor

LOOKUP = "lookup"  # the prompt-lookup source's name in statistics (``MARSGenerateOutput``, serving usage)
MASKS = "masks"  # the masks' own drafts
ASSISTANT = "assistant"  # a separate draft model's (``assistant_model=``, docs/method.md §5)
# the masks' drafts with the draft model's continuation after them (the draft model reads the row's
# tokens and the mask drafts; docs/method.md §5): one chain, checked left to right like any other
CHAINED = "masks+assistant"
SOURCES = (MASKS, LOOKUP, ASSISTANT, CHAINED)
DEFAULT_MAX_NGRAM = 2  # transformers' default ``max_matching_ngram_size``


@dataclass(frozen=True)
class Drafts:
    """A chain of proposed tokens for the positions after a row's tokens, checked left to right.

    ``confidence``: the mask drafts' own (calibrated) probabilities, one per mask draft at the head of the
    chain (a chained proposal's draft-model tokens follow them; other sources have none).
    """

    tokens: tuple[int, ...] = ()
    confidence: tuple[float, ...] = ()
    source: str = MASKS

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, count: int) -> Drafts:
        """The first ``count`` drafts (the rest are proposals nobody checks: dropping them never changes what
        verify keeps, only how much it can keep). A chained proposal cut inside its mask part is the masks'."""
        if count >= len(self.tokens):
            return self
        count = max(count, 0)
        source = MASKS if self.source == CHAINED and count <= len(self.confidence) else self.source
        return Drafts(self.tokens[:count], self.confidence[:count], source)


NO_DRAFTS = Drafts()


class DraftSource(Protocol):
    """Proposes drafts for rows; ``rooms[i]``: how many drafts row ``i`` may take at most. A source never
    changes a row: the decoder assigns what the planner chooses."""

    name: str

    def propose(self, rows: Sequence, rooms: Sequence[int]) -> list[Drafts]: ...


# ------------------------------------------------------------------------------------------------
# The sources
# ------------------------------------------------------------------------------------------------


class MaskDrafts:
    """The masks' drafts: the predictions of the mask group that follows each row's kept prefix in the forward
    just run (groups may hold fewer than W masks: the planner sizes them), cut where their confidence falls
    below the row's proposal floor. Their (calibrated) probabilities travel with them: the planner's
    estimate of their worth.

    A sampled row's draft for the token at position ``t`` is its mask's keyed draw at ``t`` (the noise the check
    at ``t`` will use): the closer the mask's distribution is to the model's, the likelier the two draws agree.
    """

    name = MASKS

    def __init__(self, step, plans, processing):
        self.step, self.plans, self.processing = (
            step,
            plans,
            processing,
        )  # acceptance.StepLogits, layouts.RowPlan

    def propose(self, rows, rooms, groups: Sequence[tuple[int, int]] = ()) -> list[Drafts]:
        """``groups[i]``: ``(index in the step, drafts kept)`` of ``rows[i]``: its drafts are the mask group
        after that kept prefix."""
        if not rows:
            return []
        kept, kept_at, plans = [k for _, k in groups], dict(groups), self.plans
        raw, spans = self.step.gather_spans(
            [s for s, _ in groups], lambda s: plans[s].group_columns[kept_at[s]]
        )
        # mask j of the group after kept prefix k predicts the token at len(tokens) + k + 1 + j
        draws = (
            None
            if rows[0].noise is None
            else [(row.noise, len(row.tokens) + k + 1) for row, k in zip(rows, kept)]
        )
        tokens, confidences = self.processing.proposed(raw, spans, draws, self.step.calibration)
        proposals = []
        for i, (start, width) in enumerate(spans):
            count = proposal_count(confidences[start : start + width], rows[i].floor)
            count = min(count, max(rooms[i], 0))
            proposals.append(
                Drafts(tuple(tokens[start : start + count]), tuple(confidences[start : start + count]))
            )
        return proposals


class PromptLookup:
    """Prompt lookup with transformers' meaning (its ``PromptLookupCandidateGenerator``): the continuation of
    the first earlier occurrence of a row's last n-gram (``lookup_drafts``), with each row's own
    ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``. Deterministic; a sampled row keeps a lookup
    draft where it equals the row's keyed draw there."""

    name = LOOKUP

    def propose(self, rows, rooms) -> list[Drafts]:
        out = []
        for row, room in zip(rows, rooms):
            settings = row.settings
            found = lookup_drafts(
                row.tokens, settings.prompt_lookup_num_tokens, settings.max_matching_ngram_size, row.eos
            )
            out.append(Drafts(tuple(found[: max(room, 0)]), (), LOOKUP))
        return out


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


class AssistantDrafts:
    """A separate draft model's tokens (docs/method.md §5): its greedy stock ``generate`` after each context,
    left-padded, ``num_tokens`` new tokens, cut after an EOS; for sampled rows with the row's keyed noise at
    each position added to its scores (``sampling.KeyedNoiseProcessor``: the draw coupled to the one the
    target makes at the same position)."""

    name = ASSISTANT

    @classmethod
    def for_target(cls, target, model, num_tokens: int, pad_token_id: int) -> AssistantDrafts:
        """``model``'s drafts for ``target``, once :func:`check_same_vocabulary` has passed them."""
        check_same_vocabulary(target, model)
        return cls(model, num_tokens, pad_token_id, target.device)

    def __init__(self, model, num_tokens: int, pad_token_id: int, device):
        self.model, self.num_tokens, self.pad_token_id, self.device = (
            model,
            int(num_tokens),
            pad_token_id,
            device,
        )

    def propose(
        self, rows, rooms, heads: Sequence[int] | None = None, held: Sequence[Drafts] = ()
    ) -> list[Drafts]:
        """``heads[i]`` > 0: continue after row ``i``'s first ``heads[i]`` held mask drafts (*chained*)."""
        heads = list(heads) if heads is not None else [0] * len(rows)
        contexts = [
            list(row.tokens) + list(held[i].tokens[: heads[i]] if heads[i] else ())
            for i, row in enumerate(rows)
        ]
        noises = [row.noise for row in rows] if rows and rows[0].noise is not None else None
        new = self.generate(contexts, noises)
        out = []
        for i, row in enumerate(rows):
            tokens = new[i][: max(rooms[i], 0)]
            for j, token in enumerate(tokens):
                if token in row.eos:
                    tokens = tokens[: j + 1]
                    break
            if heads[
                i
            ]:  # the mask drafts keep their confidences: they say where the draft model's part starts
                mask = held[i].first(heads[i])
                out.append(Drafts(mask.tokens + tuple(tokens), mask.confidence, CHAINED))
            else:
                out.append(Drafts(tuple(tokens), (), ASSISTANT))
        return out

    @torch.no_grad()
    def generate(self, contexts, noises=None) -> list[list[int]]:
        """The draft model's new tokens after each context (a token list)."""
        longest = max(len(c) for c in contexts)
        pad = self.pad_token_id
        ids = torch.tensor([[pad] * (longest - len(c)) + c for c in contexts], device=self.device)
        mask = torch.tensor([[0] * (longest - len(c)) + [1] * len(c) for c in contexts], device=self.device)
        processors = LogitsProcessorList()
        if noises is not None:
            processors.append(KeyedNoiseProcessor(noises, [len(c) for c in contexts], longest))
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.num_tokens,
            min_new_tokens=0,
            do_sample=False,
            logits_processor=processors,
            pad_token_id=pad,
            eos_token_id=None,  # every row proposes its tokens; verify stops at an EOS it keeps
        )
        sequences = out.sequences if hasattr(out, "sequences") else out
        return sequences[:, longest:].tolist()


# ------------------------------------------------------------------------------------------------
# Choosing among them
# ------------------------------------------------------------------------------------------------


class DraftChooser:
    """Offers each row the drafts worth most this step (see the module docstring); one per planner.

    Args:
        cost_table: ``batch size -> CostTable`` (the planner's measured curves).
        positions_left: ``row -> extra positions`` the model still has for the row's drafts and masks.
        assistant: an ``AssistantDrafts`` (None: no draft model).
    """

    def __init__(self, *, cost_table, positions_left, assistant: AssistantDrafts | None = None):
        self.cost_table = cost_table
        self.positions_left = positions_left
        self.assistant = assistant
        self.lookup = PromptLookup()

    @staticmethod
    def draft_probs(drafts: Drafts, stats, do_sample: bool) -> list[float]:
        """Chance that each draft is kept given the ones before it (``stats``: the row's ``RowStats``). Prompt
        lookup's: its observed acceptance per offset. Sampled mask drafts: the masks' observed acceptance (a
        keyed draw's own probability says little of whether the model's draw at its position agrees)."""
        if drafts.source == CHAINED:  # mask drafts (calibrated), then the draft model's (observed)
            follow = stats.assistant.future()[: len(drafts) - len(drafts.confidence)]
            return stats.masks.calibrated(list(drafts.confidence)) + follow
        if drafts.source != MASKS:
            return stats.of(drafts.source).future()[: len(drafts)]
        if do_sample:
            return stats.masks.future()[: len(drafts)]
        return stats.masks.calibrated(list(drafts.confidence[: len(drafts)]))

    def with_lookup(self, row, held: Drafts, stats, batch: int) -> Drafts:
        """Prompt lookup's drafts instead of ``held`` when their chain is worth more: expected drafts kept
        (from the row's observed acceptance per source) less what checking them costs, at the best length
        (``draft_value``); a re-probe of the masks keeps theirs."""
        if not row.prefilled or (stats.masks.probing and held):
            # the prompt's last n-gram is its end (a chat template's assistant header), whose earlier
            # occurrences continue into another turn: a first lookup there fails and would cost the
            # source its prior
            return held
        room = self.room_for_drafts(row)
        if room <= 0:
            return held
        found = self.lookup.propose([row], [room])[0]
        if not found:
            return held
        table = self.cost_table(batch)
        mine = self.draft_value(row, stats, stats.lookup.future()[: len(found)], table)
        if mine > self.held_value(row, held, stats, table):
            return found
        stats.lookup.forget()
        return held

    def with_assistant(self, rows, held: list[Drafts], stats: list, deciding) -> list[Drafts]:
        """docs/method.md §5: the draft model (if any) continues each deciding row that uses it (one batched
        stock ``generate`` call per sampling mode). Per row, before anything is drawn, the proposals are valued
        as the planner values drafts (``draft_value``: expected drafts kept, less λ × the extra cost of their
        columns):

        - the masks' drafts alone (``held``, from the last step);
        - the draft model's ``num_tokens`` tokens after the row's tokens (*plain*);
        - greedy rows only: the first ``j`` mask drafts, then the draft model's tokens after the row's tokens
          *and* those ``j`` drafts (*chained*, for the best ``j``): the mask drafts' calibrated probabilities
          value the first part, the draft model's observed acceptance the rest, reached only if every mask
          draft before it is kept.

        The draft model runs only for rows where its proposal is worth more than the masks' drafts alone.
        Greedy rows compare again once the tokens are known (an EOS shortens a chain); sampled rows take
        what was chosen (plain drafts only). τ rows take the paper's ``num_tokens`` drafts unvalued.
        Returns each row's offer (``held`` where nothing beats it)."""
        offers = list(held)
        if self.assistant is None:
            return offers
        eligible = [
            i
            for i, (row, decides) in enumerate(zip(rows, deciding))
            if decides and stats[i].assistant is not None and not (stats[i].masks.probing and held[i])
        ]  # a re-probe keeps the masks'
        if not eligible:
            return offers
        # τ rows take the paper's k drafts without valuing them: no cost curve needed for them alone
        table = self.cost_table(len(rows)) if any(rows[i].verify for i in eligible) else None
        options = {i: self._option(rows[i], held[i], stats[i], table) for i in eligible}
        for do_sample in (False, True):  # one draft-model call per sampling mode (keyed noise or none)
            picked = [(i, options[i]) for i in eligible if rows[i].do_sample == do_sample and options[i]]
            if not picked:
                continue
            chosen = self.assistant.propose(
                [rows[i] for i, _ in picked],
                [count for _, (_, count) in picked],
                heads=[head for _, (head, _) in picked],
                held=[held[i] for i, _ in picked],
            )
            for (i, (head, _)), offer in zip(picked, chosen):
                if self.still_worth(rows[i], held[i], stats[i], head, offer, table):
                    offers[i] = offer
        return offers

    def _option(self, row, held: Drafts, stats, table) -> tuple[int, int] | None:
        """``(head, count)``: the draft model's ``count`` tokens after the row's first ``head`` mask drafts
        (``head = 0``: plain), whichever chain is worth most, or None when the masks' drafts alone (or no
        drafts) are worth as much. Reads the row's statistics only, never a draft's value."""
        room = self.room_for_drafts(row)
        if room <= 0:
            return None
        tokens = self.assistant.num_tokens
        if not row.verify:  # τ (docs/method.md §5): the paper's fixed k drafts, whatever the machine
            return 0, min(tokens, room)
        follow = stats.assistant.future()
        masks = self.draft_probs(held, stats, row.do_sample) if held else []
        best, option = self.held_value(row, held, stats, table, masks), None
        heads = 0 if row.do_sample else self.chainable(held, row.eos, room)
        for head in range(heads + 1):
            count = min(tokens, room - head)
            if count <= 0:
                break
            value = self.draft_value(row, stats, masks[:head] + follow[:count], table)
            if value > best:
                best, option = value, (head, count)
        return option

    def still_worth(self, row, held: Drafts, stats, head: int, offer: Drafts, table) -> bool:
        """A greedy verify row takes the draft model's chain only if, cut after an EOS, it is still worth more
        than the masks' drafts alone."""
        if len(offer) <= head:
            return False
        if not row.verify or row.do_sample:
            return True
        masks = self.draft_probs(held, stats, False) if held else []
        follow = stats.assistant.future()[: len(offer) - head]
        return self.draft_value(row, stats, masks[:head] + follow, table) > self.held_value(
            row, held, stats, table, masks
        )

    def room_for_drafts(self, row) -> int:
        """Drafts a row may check this step: the tokens left but one (the step's own token), and its
        positions left."""
        return min(row.settings.max_new_tokens - row.generated - 1, self.positions_left(row))

    @staticmethod
    def chainable(held: Drafts, eos: Collection[int], room: int) -> int:
        """Mask drafts the draft model may continue after: those before the first EOS (nothing follows a
        kept EOS), leaving room for at least one of its tokens."""
        usable = len(held)
        for j, token in enumerate(held.tokens):
            if token in eos:
                usable = j
                break
        return max(0, min(usable, room - 1))

    @staticmethod
    def source_outcome(drafts: Drafts, kept: int) -> tuple[int, int]:
        """``(checked, kept)`` of a draft source's own part of the chain a row checked: all of it, but for a
        chained proposal only the draft model's tokens after the mask drafts, reached only when every mask
        draft was kept."""
        if drafts.source != CHAINED:
            return len(drafts), kept
        head = len(drafts.confidence)
        if kept < head:
            return 0, 0
        return len(drafts) - head, kept - head

    def held_value(self, row, held: Drafts, stats, table, probs=None) -> float:
        """What ``held`` is worth fed alone (0: no drafts); ``probs``: its ``draft_probs`` when known already."""
        if not held:
            return 0.0
        return self.draft_value(
            row, stats, self.draft_probs(held, stats, row.do_sample) if probs is None else probs, table
        )

    @staticmethod
    def draft_value(row, stats, probs, table) -> float:
        """``max_k [E[kept among the first k drafts] − λ·(cost(base + k) − cost(base))]`` (k = 0: 0):
        what feeding a chain of drafts alone is worth this step (the planner's objective, no masks)."""
        base = len(row.tokens) - row.committed + (0 if row.prefilled else row.lead)
        gain, start = max(1.0, stats.masks.gain), table.effective(base)
        best, chain, reach = 0.0, 0.0, 1.0
        for k, p in enumerate(probs, 1):
            reach *= p
            chain += reach
            best = max(best, chain - gain * (table.effective(base + k) - start))
        return best


def vocabulary_sizes(model) -> set[int]:
    """The sizes a model's vocabulary goes by: its embedding rows, ``config.vocab_size`` (transformers compares
    these) and, for a MARS model, the rows before its mask token was added (``config.mars["base_vocab_size"]``)."""
    sizes = {int(model.get_input_embeddings().weight.shape[0])}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for size in (
        getattr(config, "vocab_size", None),
        (getattr(model.config, "mars", None) or {}).get("base_vocab_size"),
    ):
        if isinstance(size, int) and not isinstance(size, bool):
            sizes.add(size)
    return sizes


def check_same_vocabulary(target, assistant) -> None:
    """A draft model must share the target's tokenizer: token ids pass both ways unchanged, so another
    vocabulary indexed past an embedding matrix (a raw ``IndexError``) or drafted the wrong tokens. Compared as
    transformers compares them (vocabulary sizes), allowing the rows a MARS target added for its mask token."""
    mine, theirs = vocabulary_sizes(target), vocabulary_sizes(assistant)
    if mine & theirs:
        return
    raise ValueError(
        f"`assistant_model` has another vocabulary than the model ({sorted(theirs)} tokens against "
        f"{sorted(mine)}): MARS passes token ids between them unchanged, so it needs a draft model with the "
        "same tokenizer (e.g. a smaller model of the same family). transformers' universal assisted decoding "
        "(`tokenizer=` and `assistant_tokenizer=`, translating between vocabularies) is not supported with MARS: "
        "pass a draft model with the model's tokenizer, or drop the MARS settings and pass `tokenizer` and "
        "`assistant_tokenizer` for transformers' own assisted decoding."
    )
