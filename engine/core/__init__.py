"""The compiled model and its machinery: what every front end stands on.

``model.CompiledModel`` (weights on the mesh, the KV cache, bucket graphs, compile / save / load,
``forward``), the graphs it compiles (``graphs``: prefill, first-token selection, decode with the
in-graph sampler of ``sampling``), buckets and bucket-config files, the on-disk compile cache and
saved artifacts, sharding, the memory plan, input checking, checkpoint resolution (bundled
models, training runs) and multi-host start-up.

May import: ``aotlm.models``, ``aotlm.kernels`` and the top-level utilities (``progress``,
``durable``). Never ``generate``, ``text``, ``jobs``, ``tune`` or ``cli``.
"""
