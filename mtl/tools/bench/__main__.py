"""``python -m mtl.tools.bench``: the weighting benchmark's command line (mtl/bench/sweep.py)."""

import sys

from mtl.bench.sweep import main

if __name__ == "__main__":
    sys.exit(main())  # main's exit code: 2 on a config error or an --on-change refuse
