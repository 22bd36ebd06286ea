"""``python -m pagekv.sim``: the ``pagekv sim`` command on its own."""

import sys

from pagekv.sim.cli import main

sys.exit(main())
