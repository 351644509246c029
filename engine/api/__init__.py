"""What ``from_pretrained`` returns: the model classes users hold.

``causal_lm`` (``CausalLMForSampling`` / ``AutoModelForSampling``: a ``CompiledModel`` with
``sample()``), ``families`` (one ``<Family>ForSampling`` class per family, transformers-neuronx's
names), ``neuron_config`` (``NeuronConfig``, ``GQA``), ``pipelined`` (pipeline parallelism:
``PipelineForSampling``) and ``extensions`` (the graph kinds strategies add: beams, speculation,
broadcasting).

May import: ``aotlm.batching``, ``aotlm.generate``, ``aotlm.core`` and everything below them.
"""
