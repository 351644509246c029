"""``aotlm.speculation``: transformers-neuronx's module path for ``SpeculativeGenerator``."""

from aotlm.generate.speculative import SpeculativeGenerator

__all__ = ["SpeculativeGenerator"]
