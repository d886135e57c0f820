"""``python -m convergenced.tools.demo``: the same as ``convergenced demo``."""

import sys

from convergenced.tools.demo.main import main

sys.exit(main())
