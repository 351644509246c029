"""Batch front ends: gpt-simple style JSONL batch-generate (``plan``, ``dryrun``, ``batch``,
``model_refs``), the Cerebras-style HDF5 runner (``h5``) and the SambaNova-style compile / run
split over saved artifacts (``artifact_run``).

May import: ``aotlm.text``, ``aotlm.generate``, ``aotlm.core`` and below (not ``tune``, ``cli``).
"""
