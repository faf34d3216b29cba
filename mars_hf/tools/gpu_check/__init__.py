"""A prepared GPU check: MARS decoding and training on random weights of real shapes, in one budgeted run.

Why random weights: the check must run on a machine without network or Hub, and speed does not depend
on what the weights say, only on their shapes and on how many tokens each forward accepts. That number
is *forced* instead of learned (see `forced_acceptance`): the model's own next-token prediction becomes
a known function of the position, and each mask's prediction agrees with it at a chosen rate, with a
peaked distribution (so thresholds pass) or, where it disagrees, a wrong token at probability ~0.62 (so
thresholds fail and verification rejects it). The forced logits are written by a hook on the LM head
inside the model's forward, after the real head has run, so every forward costs what it really costs.

Each measurement is one *item* (a model build, a decoding group = one model x rate x batch size with every
configuration interleaved, an exactness check, a training step). Items run in priority order; before
each, its cost is estimated from what has been measured so far, and an item that does not fit the rest
of ``--budget-seconds`` is skipped and recorded with the reason. A timer also interrupts a running item
at the deadline. The JSON is rewritten after every item, so a killed run still leaves its results.

``--tiny`` runs the same plan with tiny shapes on the CPU (the test suite runs it).

The rooms: `arguments` (what to measure), `random_models` (the shapes, models and prompts),
`forced_acceptance`, `generation` (synchronised `generate`), `budget` (the clock and the
deadline), `estimates` (what an item will cost), `machine` (environment and memory), the three sections
`decoding`, `exactness` and `training`, `runner` (the plan, item by item) and `report` (the table).
"""

from mars_hf.tools.gpu_check.arguments import GPUCheckArguments, tiny_arguments
from mars_hf.tools.gpu_check.report import format_table
from mars_hf.tools.gpu_check.runner import run_gpu_check

__all__ = ["GPUCheckArguments", "format_table", "run_gpu_check", "tiny_arguments"]
