"""``python -m benchmarks.gpu``: ``dualrl bench --gpu`` (and its yardstick child processes)."""

import sys

from benchmarks.gpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
