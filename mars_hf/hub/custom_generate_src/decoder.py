"""The MARS step loop with a cursor cache (MARS_SPEC §2-§3, §6).

Each step forwards, per row, its *fresh* tokens (accepted last step, not cached yet; the left-padded prompt at
the first step), its drafts (verify) and up to ``W`` mask tokens after them: the fixed linear layout, plain
causal attention. Afterwards the cache keeps the fresh tokens and, under verify, the drafts that were kept;
the rest (masks, rejected drafts) is cropped off the end. Rows of a batch keep different numbers of columns:
the shorter ones leave *holes* that the 2D attention mask hides from then on, while position ids follow each
row's real tokens. One ``DynamicCache``, one crop per step; finished rows leave the cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .rules import confidences, one_token_per_step, passes, proposal_count, threshold_count, verify_drafts
from .sampling import RowNoise


class Row:
    """One batch row's state between steps."""

    def __init__(self, b: int, padded_prompt: list[int], lead: int, tau: float | None, window: int, noise):
        self.b = b  # batch index: row of the token buffer and of the output, and the row key of its seed
        self.length = len(padded_prompt) - lead  # real tokens so far: the position of the next token
        self.column = len(padded_prompt)  # buffer column of the next token (stock layout, padding included)
        self.fresh = list(padded_prompt)  # tokens to feed, not cached yet
        self.lead = lead  # leading padding columns among them (first step only)
        self.cached = 0  # real tokens whose keys/values are in the cache
        self.generated: list[int] = []
        self.drafts: list[int] = []
        self.tau = 0.0 if tau is None else float(tau)
        self.floor = self.tau  # verify: the proposal floor
        self.window = window  # masks per step at most (0: one token per step)
        self.noise = noise
        self.finished = False


class Decoder:
    """Steps a batch of rows until each has finished.

    ``settings``: ``acceptance``, ``thresholds`` (one per row), ``window``, ``mask_token_id``, ``calibration``;
    ``stopping_criteria``: the call's criteria other than max length and EOS, checked token by token.
    """

    def __init__(
        self, model, input_ids, leads, settings, processing, stopping_criteria, eos, max_new, pad, seed
    ):
        self.model, self.settings, self.processing = model, settings, processing
        self.criteria, self.eos, self.max_new, self.pad = stopping_criteria, frozenset(eos), max_new, pad
        self.verify = settings.acceptance == "verify"
        self.limit = _position_limit(model.config)
        self.cache = DynamicCache(config=model.config)
        if any(type(layer) is not DynamicLayer for layer in self.cache.layers):
            raise ValueError(
                "custom_generate/ decodes models whose layers all use full attention (its cache is cropped after "
                "every step); decode this model with mars_hf (`pip install mars-hf`)."
            )
        self.attention: torch.Tensor | None = None  # [live rows, cached columns]: 1 = a real cached token
        self.rows: list[Row] = []  # every row, in batch order
        for b, (ids, lead, tau) in enumerate(zip(input_ids.tolist(), leads, settings.thresholds)):
            noise = RowNoise(seed, b) if seed is not None else None
            window = 0 if one_token_per_step(settings.acceptance, tau) else settings.window
            self.rows.append(Row(b, ids, lead, tau, window, noise))
        self.live = [row for row in self.rows if max_new > 0]
        self.num_forwards = 0
        self.score_records: list | None = None  # set to a list to keep (row, start, scores, logits)

    @torch.no_grad()
    def step(self) -> list[tuple[Row, list[int]]]:
        """One forward for every live row; returns what each kept."""
        rows = self.live
        feeds = [self._feed(row) for row in rows]
        width = max(len(feed) for feed, _ in feeds)
        device = self.model.device
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        fed = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, (feed, _)) in enumerate(zip(rows, feeds)):
            ids[i, : len(feed)] = torch.tensor(feed)
            positions[i, row.lead : len(feed)] = torch.arange(row.cached, row.cached + len(feed) - row.lead)
            fed[i, row.lead : len(feed)] = 1
        fed = fed.to(device)
        mask = fed if self.attention is None else torch.cat([self.attention, fed], dim=1)
        first = min(len(row.fresh) for row in rows) - 1  # the first column whose logits a rule reads
        logits = self.model(
            input_ids=ids.to(device),
            attention_mask=mask,
            position_ids=positions.to(device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=width - first,
        ).logits
        self.num_forwards += 1
        masks = [count for _, count in feeds]
        decide = self._verify if self.verify else self._threshold
        return self._keep(rows, decide(rows, masks, logits, first), fed, width)

    def _feed(self, row: Row) -> tuple[list[int], int]:
        """The row's columns (fresh tokens, drafts, masks) and how many masks; masks and drafts stop at the
        tokens left to generate and the model's position table (MARS_SPEC §2: at most W masks)."""
        remaining = self.max_new - len(row.generated)
        extra = self.limit - row.length if self.limit else remaining + self.settings.window
        row.drafts = row.drafts[: max(extra, 0)]
        masks = max(0, min(row.window, remaining - 1, extra, extra - len(row.drafts)))
        return row.fresh + row.drafts + [self.settings.mask_token_id] * masks, masks

    @staticmethod
    def _gather(logits, columns: list[list[int]], first: int):
        """float32 logits of each row's step columns, one row after the other, and each row's (start, count)."""
        pairs, spans = [], []
        for i, row_columns in enumerate(columns):
            spans.append((len(pairs), len(row_columns)))
            pairs += [(i, c - first) for c in row_columns]
        which = torch.tensor(pairs, device=logits.device).T
        return logits[which[0], which[1]].float(), spans

    @staticmethod
    def _draws(rows, firsts):
        """Each row's keyed draw ``(noise, position of its first prediction)``; None when greedy (all rows share
        the call's sampling)."""
        return (
            None if rows[0].noise is None else [(row.noise, row.length + k) for row, k in zip(rows, firsts)]
        )

    def _threshold(self, rows, masks, logits, first):
        """τ rows (MARS_SPEC §2): prediction 0 at the last fresh token, always kept, then the masks' predictions
        left to right while they pass τ."""
        columns = [list(range(len(row.fresh) - 1, len(row.fresh) + m)) for row, m in zip(rows, masks)]
        raw, spans = self._gather(logits, columns, first)
        metric, where = self.settings.acceptance, ([row.b for row in rows], [row.column for row in rows])
        scores, tokens = self.processing.chosen(raw, spans, *where, self._draws(rows, [0] * len(rows)))
        chosen, values = confidences(scores, tokens, metric, spans, self.settings.calibration)
        results = []
        for row, (start, count) in zip(rows, spans):
            limit = min(count, self.max_new - len(row.generated))
            n = threshold_count([passes(v, row.tau, metric) for v in values[start : start + count]], limit)
            final = self._stops(row, chosen[start : start + n])
            self._record(row, scores[start : start + len(final)], raw[start : start + len(final)])
            results.append((final, len(row.fresh), 0))
        return results

    def _verify(self, rows, masks, logits, first):
        """Verify rows (MARS_SPEC §6): check last step's drafts (check j at the real token before draft j) against
        the model's own argmax or keyed draw; rows that kept them all get new drafts from the masks after them."""
        columns = [list(range(len(row.fresh) - 1, len(row.fresh) + len(row.drafts))) for row in rows]
        raw, spans = self._gather(logits, columns, first)
        where, fed = ([row.b for row in rows], [row.column for row in rows]), [row.drafts for row in rows]
        scores, own = self.processing.checked(raw, spans, *where, fed, self._draws(rows, [0] * len(rows)))
        own = own.tolist()
        results, followers, mask_columns = [], [], []
        for row, (start, _), m in zip(rows, spans, masks):
            kept = verify_drafts(row.drafts, own[start : start + len(row.drafts)])
            new = (row.drafts[:kept] + [own[start + kept]])[: self.max_new - len(row.generated)]
            final = self._stops(row, new)
            self._record(row, scores[start : start + len(final)], raw[start : start + len(final)])
            committed = min(kept, len(final))
            results.append((final, len(row.fresh) + committed, committed))
            if not row.finished and len(final) == len(new) and kept == len(row.drafts) and m:
                followers.append((row, kept, len(final)))
                mask_columns.append(list(range(len(row.fresh) + kept, len(row.fresh) + kept + m)))
            else:
                row.drafts = []
        if followers:  # a sampled row's draft at t is its mask's keyed draw at t
            raw, spans = self._gather(logits, mask_columns, first)
            draws = self._draws([row for row, _, _ in followers], [kept + 1 for _, kept, _ in followers])
            tokens, probs = self.processing.proposed(raw, spans, draws, self.settings.calibration)
            for (row, _, taken), (start, width) in zip(followers, spans):
                n = proposal_count(probs[start : start + width], row.floor)  # drafts stop below the floor
                room = self.max_new - len(row.generated) - taken - 1
                row.drafts = tokens[start : start + min(n, max(room, 0))]
        return results

    def _stops(self, row: Row, tokens: list[int]) -> list[int]:
        """``tokens`` cut right after an EOS or where a stopping criterion ends the row (checked token by token,
        as stock decoding does); marks the row finished then, or when it has ``max_new_tokens``."""
        end = next((j + 1 for j, token in enumerate(tokens) if token in self.eos), None)
        checked = tokens if end is None else tokens[:end]
        stop = end is not None
        if self.criteria and checked:
            self.processing.write([(row.b, row.column + j) for j in range(len(checked))], checked)
            for j in range(len(checked)):
                if bool(self.criteria(self.processing.sequences[:, : row.column + j + 1], None)[row.b]):
                    checked, stop = checked[: j + 1], True
                    break
        row.finished = stop or len(row.generated) + len(checked) >= self.max_new
        return checked

    def _record(self, row, scores, logits) -> None:
        if self.score_records is not None and scores.shape[0]:
            self.score_records.append((row.b, len(row.generated), scores, logits))

    def _keep(self, rows, results, fed, width):
        """Append kept tokens, keep each row's committed columns in the cache, crop the rest, drop finished rows."""
        committed = torch.tensor([columns for _, columns, _ in results], device=fed.device)
        keep = int(committed.max())
        if keep < width:
            self.cache.crop(keep - width)
        valid = fed[:, :keep] * (torch.arange(keep, device=fed.device)[None, :] < committed[:, None])
        self.attention = valid if self.attention is None else torch.cat([self.attention, valid], dim=1)
        kept = []
        for row, (final, columns, from_drafts) in zip(rows, results):
            self.processing.write([(row.b, row.column + j) for j in range(len(final))], final)
            row.cached += columns - row.lead
            row.fresh, row.lead = final[from_drafts:], 0
            row.generated += final
            row.length += len(final)
            row.column += len(final)
            if row.noise is not None:
                row.noise.forget_before(row.length)
            kept.append((row, final))
        alive = [i for i, row in enumerate(rows) if not row.finished]
        if len(alive) < len(rows):
            index = torch.tensor(alive, dtype=torch.long, device=fed.device)
            self.cache.batch_select_indices(index)
            self.attention = self.attention[index]
            self.live = [rows[i] for i in alive]
        return kept


def _position_limit(config) -> int | None:
    """The model's position table (absolute-position models cannot place a mask past it), or None."""
    config = config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
