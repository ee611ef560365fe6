"""QM9's target standardisation: ours (the training split's mean and std) against Nash-MTL's code's (all 130,831
molecules, test and validation included): ``python -m mtl.tools.bench.qm9_norm``.

    python -m mtl.tools.bench.qm9_norm [--config configs/qm9.yaml] [--seed 0] [--runs] [override ...]

Prints, per task, the two means and stds and how far apart they are: the shift of the mean in units of our std,
``(mean_all - mean_train) / std_train``, and the ratio of the stds less 1. The training split is the config's (the
papers' split for ``--seed``; ``data.qm9.train_size`` keeps its first molecules, as qm9_cpu.yaml does).

``--runs``: also trains the config with ``weighting.method=equal`` three times on the same split: as mtl does, with
every head standardised by the all-molecule statistics instead (the same seed), and as mtl does from the next seed
(the run-to-run spread to read the difference against). Prints each run's test Δm % (against the config's
``optim.plateau.baselines``, the published single-task MAEs) at its evaluation with the best validation Δm, and the
second and third runs' test MAEs against the first's, as a Δm % (the mean over tasks of the relative change).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from mtl.data.qm9_source import QM9Split, load_graphs, qm9_splits
from mtl.delta_m import delta, metric_specs
from mtl.run.trainer import Trainer
from mtl.setup.checks import load_run_config
from mtl.tasks import config_task_types


def statistics_of(cfg) -> list[tuple[str, float, float, float, float]]:
    """(task, mean of the training split, of every molecule, std of the training split, of every molecule)."""
    train = qm9_splits(cfg)["train"]
    graphs = load_graphs(cfg)
    every = QM9Split(graphs, torch.arange(len(graphs)), cfg.data.qm9.graph, "all")
    types = config_task_types(cfg)
    rows = []
    for t in cfg.tasks:
        a, b = types[t].targets_of(train).double(), types[t].targets_of(every).double()
        rows.append((t, float(a.mean()), float(b.mean()), float(a.std()), float(b.std())))
    return rows


def best_evaluation(folder: str, cfg) -> tuple[float, float, int, dict]:
    """(best validation Δm, the test Δm at that evaluation, its step, its test metrics by metric key) from a run's
    metrics.jsonl."""
    specs, base = metric_specs(cfg), dict(cfg.optim.plateau.baselines)
    best = None
    for line in open(os.path.join(folder, "metrics.jsonl")):
        row = json.loads(line)
        if "plateau_delta_m" not in row:
            continue
        test = {k: row.get(f"test_{k}") for k, _, _ in specs}
        if best is None or row["plateau_delta_m"] < best[0]:
            best = (row["plateau_delta_m"], delta(test, base, specs), row["step"], test)
    return best


RUNS = ("train split", "all molecules", "train split, next seed")


def run_three(config: str, seed: int, overrides: list[str], every: dict[str, tuple[float, float]]) -> dict[str, tuple]:
    """Three runs of ``equal`` on seed ``seed``'s split: mtl's standardisation, the all-molecule one (each head's mean
    and std replaced), and mtl's again from the next seed (another initialisation and batch order, the same split:
    the run-to-run spread to read the difference against)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            folder = os.path.join(tmp, name.replace(" ", "_").replace(",", ""))
            run_seed = seed + 1 if "next seed" in name else seed
            trainer = Trainer.from_config(config, [f"output_dir={folder}", "trainer.progress=false",
                                                   "weighting.method=equal", "checkpoint.every_steps=0", *overrides,
                                                   f"seed={run_seed}", f"data.qm9.split_seed={seed}"])
            if name == "all molecules":
                for t, (mean, std) in every.items():
                    trainer.bare.heads[t].set_standardisation(mean, std)
            trainer.train()
            trainer.close()
            out[name] = best_evaluation(folder, trainer.cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtl.tools.bench.qm9_norm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join("configs", "qm9.yaml"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", action="store_true", help="also train the pair of equal runs (minutes)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    overrides = [f"seed={args.seed}", *args.overrides]
    cfg = load_run_config(args.config, overrides)
    rows = statistics_of(cfg)
    print(f"{args.config} (seed {args.seed}): target statistics, training split vs all molecules")
    print("| task | mean (train) | mean (all) | std (train) | std (all) | mean shift / std (train) | std ratio - 1 |")
    print("|---|---|---|---|---|---|---|")
    for t, ma, mb, sa, sb in rows:
        print(f"| {t} | {ma:.6g} | {mb:.6g} | {sa:.6g} | {sb:.6g} | {(mb - ma) / sa:+.2e} | {sb / sa - 1:+.2e} |")
    if args.runs:
        runs = run_three(args.config, args.seed, overrides, {t: (mb, sb) for t, _, mb, _, sb in rows})
        specs = metric_specs(cfg)
        ours = runs["train split"][3]
        for name, (val, test, step, metrics) in runs.items():
            vs_ours = "" if name == "train split" else f"; its test MAEs against the first run's: Δm {delta(metrics, ours, specs):+.2f}%"
            print(f"equal, {name}: best validation Δm {val:.1f}% at step {step}, test Δm {test:.1f}%{vs_ours}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
