"""``python -m lazytriton``: the ``lazytriton`` command, for when its script is not on PATH."""

import sys

from lazytriton.cli import main

sys.exit(main())
