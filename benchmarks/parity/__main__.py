"""``python -m benchmarks.parity``: see the package docstring."""

import sys

from benchmarks.parity.cli import main

sys.exit(main())
