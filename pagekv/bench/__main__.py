"""``python -m pagekv.bench [offline|serve] [options]``: the bench command without the CLI."""

import sys

from pagekv.bench import main

sys.exit(main())
