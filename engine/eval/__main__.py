"""``python -m aotlm.eval <lm_eval arguments>``: lm-eval's own command line, with ``--model aotlm``.

lm-eval 0.4 finds models only in its registry and loads no plugins, so its ``lm_eval`` command
cannot know aotlm; this entry registers the backend, then hands the arguments unchanged to
lm-eval's command line (every option of ``lm_eval run`` works, e.g. ``--model aotlm --model_args
pretrained=DIR,batch_size=4 --tasks T --include_path P``). Bad input (an unknown model argument,
a missing checkpoint, a task lm-eval cannot find) prints one line and exits 2, as ``aotlm`` does.
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

from aotlm.eval import register


def main() -> int:
    """Register ``--model aotlm`` and run lm-eval's command line on ``sys.argv``."""
    register()
    try:
        cli_evaluate()
    except (ValueError, TypeError, OSError) as e:  # includes aotlm's CheckpointError
        msg = " ".join(str(e).split())  # one line, whatever the source's formatting
        print(f"aotlm.eval: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
