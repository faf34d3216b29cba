"""Which drafts a verify row checks this step (docs/method.md §5, §6).

A row holds the masks' predictions from its last step as drafts. ``DraftChooser`` may replace them,
before the step is planned, with a chain worth more net of what checking it costs on the measured
curve: prompt lookup's continuation (``pick_lookup``), a draft model's continuation of the row
(``from_assistant``: plain, or *chained* after the first mask drafts). Values come from each source's
observed acceptance and the masks' calibrated confidences. Whatever is chosen, the output is the same:
a draft is kept only where it is the model's own choice (its argmax, or a sampled row's keyed draw,
``sampling.py``). ``StepFeed`` then plans the masks around the chosen drafts.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessorList

from .draft_sources import ASSISTANT, CHAINED, LOOKUP, MASKS, lookup_drafts
from .sampling import KeyedNoiseProcessor


class DraftChooser:
    """Chooses each verify row's drafts (see the module docstring); one per ``StepFeed``.

    Args:
        cost_table: ``batch size -> CostTable`` (the feed's measured curves).
        positions_left: ``row -> extra positions`` the model still has for the row's drafts and masks.
        assistant_model / assistant_tokens: the draft model (``None``: none) and how many tokens it proposes.
        pad_token_id: left padding of the draft model's batched contexts.
        device: the decoded model's device (the draft model's inputs and proposals go there).
    """

    def __init__(
        self, *, cost_table, positions_left, device, assistant_model=None, assistant_tokens=5, pad_token_id=0
    ):
        self.cost_table = cost_table
        self.positions_left = positions_left
        self.assistant = assistant_model
        self.assistant_tokens = int(assistant_tokens)
        self.pad_token_id = pad_token_id
        self.device = device

    @staticmethod
    def draft_probs(row) -> list[float]:
        """Chance that each draft in hand is kept given the ones before it. Prompt lookup's: its
        observed acceptance per offset. Sampled mask drafts: the masks' observed acceptance (a keyed
        draw's own probability says little of whether the model's draw at its position agrees)."""
        if row.draft_source == CHAINED:  # mask drafts (calibrated), then the draft model's (observed)
            follow = row.assistant_stats.future()[: len(row.drafts) - len(row.draft_confidence)]
            return row.stats.calibrated(row.draft_confidence) + follow
        if row.draft_source != MASKS:
            return row.source_stats(row.draft_source).future()[: len(row.drafts)]
        if row.do_sample:
            return row.stats.future()[: len(row.drafts)]
        return row.stats.calibrated(row.draft_confidence[: len(row.drafts)])

    def pick_lookup(self, row, batch: int) -> None:
        """Prompt lookup's drafts replace the masks' when their chain is worth more: expected drafts
        kept (from the row's observed acceptance per source) less what checking them costs, at the
        best length (``draft_value``); a re-probe of the masks keeps theirs."""
        if not row.prefilled or (row.stats.probing and row.drafts):
            # the prompt's last n-gram is its end (a chat template's assistant header), whose earlier
            # occurrences continue into another turn: a first lookup there fails and would cost the
            # source its prior
            return
        room = self._room_for_drafts(row)
        if room <= 0:
            return
        found = lookup_drafts(
            row.tokens, row.settings.prompt_lookup_num_tokens, row.settings.max_matching_ngram_size, row.eos
        )[:room]
        if not found:
            return
        table = self.cost_table(batch)
        mine = self.draft_value(row, row.lookup_stats.future()[: len(found)], table)
        if mine > self.held_value(row, table):
            row.drafts, row.draft_confidence, row.draft_source = found, [], LOOKUP
        else:
            row.lookup_stats.forget()

    @torch.no_grad()
    def from_assistant(self, rows, deciding) -> None:
        """docs/method.md §5: the draft model (if any) continues each deciding row that uses it (one
        batched stock ``generate`` call, left-padded). Per row, before anything is drawn, the proposals
        are valued as the planner values drafts (``draft_value``: expected drafts kept, less λ × the
        extra cost of their columns):

        - the masks' drafts alone (what the row holds from the last step);
        - the draft model's ``assistant_tokens`` tokens after the row's tokens (*plain*);
        - greedy rows only: the first ``j`` mask drafts, then the draft model's tokens after the row's
          tokens *and* those ``j`` drafts (*chained*, for the best ``j``): the mask drafts' calibrated
          probabilities value the first part, the draft model's observed acceptance the rest, reached
          only if every mask draft before it is kept.

        The draft model runs only for rows where its proposal is worth more than the masks' drafts
        alone. Greedy rows compare again once the tokens are known (an EOS shortens a chain);
        sampled rows take what was chosen (only plain drafts: the draft model's greedy choice after the
        row's keyed noise is added to its scores, ``sampling.KeyedNoiseProcessor``, the draw coupled to
        the one the target makes at the same position). The planner then
        feeds a prefix of the chosen drafts with mask groups after them (quadratic: fresh mask
        drafts after whatever prefix is kept)."""
        if self.assistant is None:
            return
        eligible = [
            r
            for r, d in zip(rows, deciding)
            if d and r.assistant_stats is not None and not (r.stats.probing and r.drafts)
        ]  # a re-probe keeps the masks'
        if not eligible:
            return
        # τ rows take the paper's k drafts without valuing them: no cost curve needed for them alone
        table = self.cost_table(len(rows)) if any(r.verify for r in eligible) else None
        for do_sample in (False, True):
            picked = []
            for row in eligible:
                if row.do_sample == do_sample:
                    option = self._assistant_option(row, table)
                    if option is not None:
                        picked.append((row, option))
            if not picked:
                continue
            contexts = [row.tokens + row.drafts[:head] for row, (head, _) in picked]
            noises = [row.noise for row, _ in picked] if do_sample else None
            new = self._assistant_generate(contexts, noises)
            for b, (row, (head, count)) in enumerate(picked):
                self.offer_assistant_drafts(row, head, new[b][:count], table)

    def _assistant_option(self, row, table) -> tuple[int, int] | None:
        """``(head, count)``: the draft model's ``count`` tokens after the row's first ``head`` mask drafts
        (``head = 0``: plain), whichever chain is worth most, or None when the masks' drafts alone (or no
        drafts) are worth as much. Reads the row's statistics only, never a draft's value."""
        room = self._room_for_drafts(row)
        if room <= 0:
            return None
        if not row.verify:  # τ (docs/method.md §5): the paper's fixed k drafts, whatever the machine
            return 0, min(self.assistant_tokens, room)
        follow = row.assistant_stats.future()
        masks = self.draft_probs(row) if row.drafts else []
        best, option = self.held_value(row, table, masks), None
        heads = 0 if row.do_sample else self.chainable(row, room)
        for head in range(heads + 1):
            count = min(self.assistant_tokens, room - head)
            if count <= 0:
                break
            value = self.draft_value(row, masks[:head] + follow[:count], table)
            if value > best:
                best, option = value, (head, count)
        return option

    def _room_for_drafts(self, row) -> int:
        """Drafts a row may check this step: the tokens left but one (the step's own token), and its
        positions left."""
        return min(row.settings.max_new_tokens - row.generated - 1, self.positions_left(row))

    @staticmethod
    def chainable(row, room: int) -> int:
        """Mask drafts the draft model may continue after: those before the first EOS (nothing follows a
        kept EOS), leaving room for at least one of its tokens."""
        usable = len(row.drafts)
        for j, token in enumerate(row.drafts):
            if token in row.eos:
                usable = j
                break
        return max(0, min(usable, room - 1))

    def _assistant_generate(self, contexts, noises=None) -> list[list[int]]:
        """The draft model's new tokens after each context (a token list): its greedy stock ``generate``,
        left-padded; for sampled rows (``noises``: each row's ``RowNoise``) with the row's keyed noise at
        each position added to its scores."""
        longest = max(len(c) for c in contexts)
        pad = self.pad_token_id
        ids = torch.tensor([[pad] * (longest - len(c)) + c for c in contexts], device=self.device)
        mask = torch.tensor([[0] * (longest - len(c)) + [1] * len(c) for c in contexts], device=self.device)
        processors = LogitsProcessorList()
        if noises is not None:
            processors.append(KeyedNoiseProcessor(noises, [len(c) for c in contexts], longest))
        out = self.assistant.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.assistant_tokens,
            min_new_tokens=0,
            do_sample=False,
            logits_processor=processors,
            pad_token_id=pad,
            eos_token_id=None,  # every row proposes its tokens; verify stops at an EOS it keeps
        )
        sequences = out.sequences if hasattr(out, "sequences") else out
        return sequences[:, longest:].tolist()

    def offer_assistant_drafts(self, row, head: int, drafts, table) -> None:
        """The draft model's tokens for a row (cut after an EOS), after the row's first ``head`` mask
        drafts, become the row's drafts (a greedy row checks first that the chain, shortened by an EOS,
        is still worth more than the masks' drafts alone)."""
        for j, token in enumerate(drafts):
            if token in row.eos:
                drafts = drafts[: j + 1]
                break
        if not drafts:
            return
        if row.verify and not row.do_sample:
            masks = self.draft_probs(row) if row.drafts else []
            follow = row.assistant_stats.future()[: len(drafts)]
            value = self.draft_value(row, masks[:head] + follow, table)
            if value <= self.held_value(row, table, masks):
                return
        if head:  # the mask drafts keep their confidences: they say where the draft model's part starts
            row.drafts, row.draft_confidence = row.drafts[:head] + drafts, row.draft_confidence[:head]
            row.draft_source = CHAINED
        else:
            row.drafts, row.draft_confidence, row.draft_source = drafts, [], ASSISTANT

    @staticmethod
    def source_outcome(source: str, checked: int, kept: int, fed_confidence) -> tuple[int, int]:
        """``(checked, kept)`` of a draft source's own part of the chain a row checked: all of it, but for
        a chained proposal only the draft model's tokens after the mask drafts (``fed_confidence``, one
        confidence per mask draft), reached only when every mask draft was kept."""
        if source != CHAINED:
            return checked, kept
        head = len(fed_confidence)
        if kept < head:
            return 0, 0
        return checked - head, kept - head

    def held_value(self, row, table, probs=None) -> float:
        """What the drafts a row holds (the masks' from the last step) are worth fed alone (0: none);
        ``probs``: their ``draft_probs`` when the caller has them already."""
        if not row.drafts:
            return 0.0
        return self.draft_value(row, self.draft_probs(row) if probs is None else probs, table)

    @staticmethod
    def draft_value(row, probs, table) -> float:
        """``max_k [E[kept among the first k drafts] − λ·(cost(base + k) − cost(base))]`` (k = 0: 0):
        what feeding a chain of drafts alone is worth this step (the planner's objective, no masks)."""
        base = len(row.tokens) - row.committed + (0 if row.prefilled else row.lead)
        gain, start = max(1.0, row.stats.gain), table.effective(base)
        best, chain, reach = 0.0, 0.0, 1.0
        for k, p in enumerate(probs, 1):
            reach *= p
            chain += reach
            best = max(best, chain - gain * (table.effective(base + k) - start))
        return best

    @staticmethod
    def keep(row, count: int) -> None:
        """Feed only the first ``count`` drafts (the rest are proposals nobody checks: dropping them
        never changes what verify keeps, only how much it can keep)."""
        if count < len(row.drafts):
            if row.draft_source == CHAINED and count <= len(row.draft_confidence):
                row.draft_source = MASKS  # only mask drafts of a chained proposal are fed
            row.drafts = row.drafts[:count]
            row.draft_confidence = row.draft_confidence[:count]
