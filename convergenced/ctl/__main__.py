"""``python -m convergenced.ctl``: the same as the ``convergencectl`` command."""

import sys

from convergenced.ctl.main import main

sys.exit(main())
