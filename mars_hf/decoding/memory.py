"""`PlannerMemory`: what the measured step planner learns about decoding one model on this machine.

Why an object the caller owns: the planner's measured cost curves (``cost_model``), what decoding observed of
them, its drafting floors and the masks' statistics of the last verify row are worth keeping from one call to
the next (a probe costs about 2 s, and a short call would otherwise spend its first dozen steps finding out
again where drafting does not pay). Kept in process-wide tables, they made one call's plan depend on what other
calls of the process had timed. Kept here, they live exactly as long as their owner wants: a server builds one
and hands it to every decoder it makes; a caller who wants the measured planner passes one to ``generate``::

    memory = PlannerMemory()
    model.generate(**inputs, mars_acceptance="verify", mars_cost_probe=memory)  # measures, keeps it there
    model.generate(**other, mars_acceptance="verify", mars_cost_probe=memory)  # starts from what it learnt

``mars_cost_probe=True`` measures for that call alone (a fresh memory). Without either, nothing is timed: on a CPU
the planner plans on an assumed curve (``cost_model.ASSUMED_CPU_COLUMN_COST``), elsewhere the feed is the fixed
linear one, the same on every machine of a kind.

A memory serves one model (its curves are that model's): a second model gets a clear error. It pickles and
copies empty, since what it holds was measured for one process's model on one machine.
"""

from __future__ import annotations

import weakref

__all__ = ["PlannerMemory"]


class PlannerMemory:
    """The measured planner's memory of one model on this machine (see the module docstring).

    Attributes:
        cost_tables: measured (or read from ``$MARS_HF_COST_CACHE``) cost curves, by the key of what they were
            measured for (device, dtype, threads, batch bucket, probed sizes, hooks, kernels).
        observations: what decoding's own forwards observed of each curve (``cost_model.ObservedCosts``).
        floors: the drafting floor of each curve and set of draft sources (``stats.DraftingFloor``).
        mask_prior: the masks' statistics of the verify row served last, where a new verify row starts.
    """

    def __init__(self):
        self.cost_tables: dict = {}
        self.observations: dict = {}
        self.floors: dict = {}
        self.mask_prior = None
        self._model = None

    def bind(self, model) -> PlannerMemory:
        """Check that this memory serves ``model`` (the first model it meets); returns itself."""
        owner = self._model() if self._model is not None else None
        if owner is None:
            self._model = weakref.ref(model)
        elif owner is not model:
            raise ValueError(
                "This PlannerMemory holds another model's measured costs; build one PlannerMemory per model."
            )
        return self

    def clear(self) -> None:
        """Forget everything measured and observed (e.g. after the machine's load has changed for good)."""
        self.cost_tables.clear()
        self.observations.clear()
        self.floors.clear()
        self.mask_prior = None

    def __reduce__(self):
        return (PlannerMemory, ())

    def __repr__(self) -> str:
        return f"PlannerMemory({len(self.cost_tables)} cost curves, {len(self.floors)} drafting floors)"
