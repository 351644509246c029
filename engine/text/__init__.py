"""Text in, text out: tokenizers and streaming decode (``tokens``), ``pipeline()``
(``pipeline``) and the Hugging Face ``generate()`` adapter (``hf_adapter``).

May import: ``aotlm.generate``, ``aotlm.core`` and below. Imported by ``jobs`` and ``cli``.
"""
