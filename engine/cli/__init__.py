"""The ``aotlm`` command: argument parsing (``app``) and one module per command family
(``text``, ``batch`` / ``jsonl`` / ``h5``, ``tune``). Nothing else in aotlm imports it.

May import every other subpackage.
"""

from aotlm.cli.app import main

__all__ = ["main"]
