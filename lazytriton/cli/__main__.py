"""``python -m lazytriton.cli``: the ``lazytriton`` command."""

import sys

from lazytriton.cli import main

sys.exit(main())
