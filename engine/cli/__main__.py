"""``python -m aotlm.cli``: the ``aotlm`` command."""

import sys

from aotlm.cli.app import main

sys.exit(main())
