"""The time to fill one task's row of G on configs/default.yaml's backbone (docs/notes.md, 2026-12-01):
``torch.autograd.grad`` then one copy into the row (the earlier way, kept here as the
reference) against ``RowWriter`` (each parameter's gradient written into its slice as autograd computes it),
alternated in one process (which goes first alternates too), 40 rounds. Prints the medians and the per-round ratio.

    PYTHONPATH=$PWD python scripts/row_fill_time.py
"""

import statistics
import time

import torch

from mtl.setup.build import build_run_inputs
from mtl.setup.checks import load_run_config
from mtl.strategies.task_grads import RowWriter


def main() -> None:
    torch.set_num_threads(1)
    cfg = load_run_config("configs/default.yaml", ["output_dir=/tmp/row_fill_time", "data.batch_size=8",
                                                   "data.synthetic.train_size=64", "data.synthetic.val_size=8"])
    run = build_run_inputs(cfg)
    batch = next(iter(run.train_loader()))
    shared = [p for p in run.model.backbone.parameters() if p.requires_grad]
    features = run.model.backbone(batch["image"])
    g_out = torch.randn_like(features)
    row = torch.empty(sum(p.numel() for p in shared))
    writer = RowWriter(shared, row)

    def copy_after():
        g = torch.autograd.grad(features, shared, grad_outputs=g_out, retain_graph=True, materialize_grads=True)
        torch.cat([x.reshape(-1) for x in g], out=row)

    def in_place():
        writer(features, g_out)

    def timed(f):
        tic = time.perf_counter()
        f()
        return time.perf_counter() - tic

    copy_after(), in_place()
    before, after = [], []
    for r in range(40):
        pair = (timed(copy_after), timed(in_place)) if r % 2 else tuple(reversed((timed(in_place), timed(copy_after))))
        before.append(pair[0])
        after.append(pair[1])
    ratios = [a / b for a, b in zip(after, before)]
    q = statistics.quantiles(ratios, n=4)
    print(f"P = {row.numel()}: autograd.grad + copy {statistics.median(before) * 1e3:.1f} ms, RowWriter "
          f"{statistics.median(after) * 1e3:.1f} ms (medians); RowWriter / copy per round: median "
          f"{statistics.median(ratios):.3f}, quartiles {q[0]:.3f} .. {q[2]:.3f}")


if __name__ == "__main__":
    main()
