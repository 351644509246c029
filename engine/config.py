"""``aotlm.config``: transformers-neuronx's ``transformers_neuronx.config`` names.

``NeuronConfig`` (+ ``GQA``), ``QuantizationConfig`` and ``GenerationConfig`` (the same class as
``aotlm.GenerationConfig``: ``on_device_generation=`` sets a model's ``sample()`` defaults).
"""

from aotlm.api.neuron_config import GQA, NeuronConfig
from aotlm.generate.params import GenerationConfig
from aotlm.models.quant import QuantizationConfig

__all__ = ["GQA", "GenerationConfig", "NeuronConfig", "QuantizationConfig"]
