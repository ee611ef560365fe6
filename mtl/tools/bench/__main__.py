"""``python -m mtl.tools.bench``: the weighting benchmark's command line (mtl/tools/bench/sweep.py)."""

from mtl.tools.bench.sweep import main

if __name__ == "__main__":
    main()
