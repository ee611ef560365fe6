"""How QM9's bonds were found: the share of molecules whose bonds perceived from the geometry agree with the SMILES.

    python -m mtl.tools.qm9_bonds [--sample N] [--seed 0] [--cache-dir DIR]

Without ``--sample``: the report of the whole data set, as ``mtl.data.qm9.load_qm9pack`` built (or builds) it.
With ``--sample N``: N molecules drawn at random (seeded) from qm9pack's CSV, perceived now (nothing is cached).
"""

from __future__ import annotations

import argparse
import sys

from mtl.data import qm9
from mtl.errors import MTLError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None)
    a = p.parse_args(argv)

    import torch

    try:
        if a.sample is None:
            report = qm9.load_qm9pack(a.cache_dir, log=lambda m: print(m, file=sys.stderr)).report
        else:
            rows = qm9.read_csv_rows(qm9.qm9pack_folder())
            if not 0 < a.sample <= len(rows):
                p.error(f"--sample must be in 1..{len(rows)}")
            pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(a.seed))[:a.sample]
            _, report = qm9.build_from_rows([rows[i] for i in sorted(pick.tolist())])
    except MTLError as e:
        print(e.message, file=sys.stderr)
        return e.exit_code
    n = report.molecules
    print(f"{n} molecules" + (f" (a random sample, seed {a.seed})" if a.sample else "") + ":")
    for step in qm9.PERCEIVE_STEPS:
        count = getattr(report, step)
        print(f"  {step:20s} {count:7d}  {100 * count / max(1, n):6.2f}%")
    print(f"  bonds from the geometry alone agree with the SMILES: {100 * report.agreement():.2f}%")
    print(f"  bond orders from the SMILES (QM9 index): {report.smiles_indices}")
    print(f"  kept disagreeing (QM9 index): {report.disagree_indices}")
    print(f"  connectivity only, single bonds (QM9 index): {report.connectivity_indices}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
