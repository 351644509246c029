"""Evaluation with EleutherAI's lm-evaluation-harness: the ``aotlm`` model backend.

``import aotlm.eval`` registers ``LMEvalModel`` as lm-eval's ``--model aotlm``; the command line is
``python -m aotlm.eval <lm_eval arguments>``. lm-eval is an optional extra (``pip install -e
'.[eval]'``), so ``import aotlm`` never imports this package.

May import: ``aotlm.text``, ``aotlm.generate``, ``aotlm.core`` and below (the jobs/serve layer).
"""

from __future__ import annotations

try:
    import lm_eval  # noqa: F401
except ImportError as e:  # the optional extra is missing: one line saying how to get it
    raise ImportError("aotlm.eval needs lm-evaluation-harness: pip install -e '.[eval]'") from e

from aotlm.eval.lm_eval_model import MODEL_NAME, LMEvalModel, register

register()

__all__ = ["LMEvalModel", "MODEL_NAME", "register"]
