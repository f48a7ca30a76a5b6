"""``python -m dualrl ...`` = the ``dualrl`` console script."""

import sys

from dualrl.cli import main

sys.exit(main())
