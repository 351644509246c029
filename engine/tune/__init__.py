"""Bucket tuning: request-length distributions (``lengths``), the cost model and bucket search
(``optimise``), and measurement / replay runs on a real model (``measure``). Bucket-config files
are read by the model itself, so their reader and writer live in ``aotlm.core.bucket_config``.

May import: ``aotlm.generate``, ``aotlm.core`` and below (not ``text``, ``jobs``, ``cli``).
"""
