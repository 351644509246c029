"""``aotlm.stopping_criteria``: transformers-neuronx's module path for stopping rules
(``sample(..., stopping_criteria_list=StoppingCriteriaList([...]))``, checked after every token)."""

from aotlm.generate.stopping import StoppingCriteria, StoppingCriteriaList

__all__ = ["StoppingCriteria", "StoppingCriteriaList"]
