"""``python -m convergenced.ctl``: the same as the ``convergencectl`` command."""

import sys

from convergenced.ctl.commands import main

sys.exit(main())
