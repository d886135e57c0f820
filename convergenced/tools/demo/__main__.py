"""``python -m convergenced.tools.demo``: the same as ``convergenced demo``."""

import sys

from convergenced.tools.demo.command import main

sys.exit(main())
