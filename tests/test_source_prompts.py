"""Real-world prompts for self-distillation (mars_hf.training.source_prompts) and `mars-hf distill`'s sources."""

from __future__ import annotations

import pytest

from mars_hf.commands.distill import draw_prompts
from mars_hf.tools.bench import eval_sets
from mars_hf.training.source_prompts import CODE_KINDS, TEXT_KINDS, documented_functions, source_prompts


def test_source_prompts_are_distinct_seeded_and_cover_every_kind():
    prompts = source_prompts(700, seed=3)
    assert len(prompts) == len(set(prompts)) == 700
    assert prompts == source_prompts(700, seed=3) and prompts != source_prompts(700, seed=4)
    for template in list(CODE_KINDS.values()) + list(TEXT_KINDS.values()):
        lead = template.split("{")[0]
        assert any(p.startswith(lead) for p in prompts), lead


def test_a_code_prompt_quotes_a_real_standard_library_function():
    name, header, code, doc = documented_functions()[0]
    assert f"def {name}(" in code and code.startswith(header.splitlines()[0]) and doc.splitlines()[0] in code


def test_asking_for_more_than_the_library_holds_names_the_way_out():
    with pytest.raises(ValueError, match="--prompt-source mixed"):
        source_prompts(len(documented_functions()) + 1)


def test_distill_sources_mix_and_leave_out_evaluation_prompts(monkeypatch):
    stdlib = draw_prompts("stdlib", 10, seed=0)
    assert stdlib == source_prompts(10, seed=0)
    mixed = draw_prompts("mixed", 10, seed=0)
    assert len(mixed) == 10 and mixed[1::2] == source_prompts(10, seed=0)[:5]
    leaked = stdlib[2][40:140]  # an evaluation prompt quoted inside a drawn prompt
    monkeypatch.setattr(eval_sets, "available_evaluation_prompts", lambda: ([leaked], []))
    assert draw_prompts("stdlib", 10, seed=0) == stdlib[:2] + stdlib[3:]
