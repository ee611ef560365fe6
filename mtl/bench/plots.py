"""The weighting benchmark's plots (one folder per regime): validation metrics against the step (where a reader
sees the plateau) and against wall time, the loss weights, and the gradient cosine between tasks."""

from __future__ import annotations

import os
import statistics

from mtl.bench.stats import mean_ci

BASELINE_COLOURS = ("black", "dimgray", "saddlebrown", "darkslategray")  # outside the methods' palette


def write_plots(cfg, specs: list, data: dict[str, list], out: str, methods: list[str]) -> list[str]:
    """PNGs into ``out`` from ``data`` (label -> the finished runs' ``read_run`` dicts; baselines as single_<task>)
    for the metrics ``specs`` of the regime's config ``cfg``."""
    # here, not at the top: the file backend (Agg) is chosen when a figure is written, never as a side effect of
    # importing this module (an importer may have chosen another backend)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    labels = [m for m in methods if m in data]
    cmap = plt.get_cmap("tab20")
    colour = {m: cmap(i % 20) for i, m in enumerate(labels)}
    colour.update({f"single_{t}": BASELINE_COLOURS[i % len(BASELINE_COLOURS)] for i, t in enumerate(cfg.tasks)})
    tasks = list(cfg.tasks)
    paths = metric_plots(plt, specs, data, labels, colour, out)
    paths.append(weight_plot(plt, tasks, data, labels, colour, out))
    cosines = cosine_plot(plt, tasks, data, labels, colour, out)
    return paths + [cosines] * bool(cosines)


def mean_curve(runs_, key, x="step"):
    """(xs, means, 95% t-interval half-widths over seeds) of one metric at each evaluation step."""
    steps = sorted({e["step"] for d in runs_ for e in d["evals"] if e.get(key) is not None})
    xs, ys, cis = [], [], []
    for s in steps:
        vals = [(e[key], e["time"] - d["t0"]) for d in runs_ for e in d["evals"] if e["step"] == s and e.get(key)
                is not None]
        if vals:
            m, ci = mean_ci(v for v, _ in vals)
            ys.append(m)
            cis.append(ci if ci == ci else 0.0)  # one seed: no band
            xs.append(s if x == "step" else statistics.mean(t for _, t in vals))
    return xs, ys, cis


def train_curve(runs_, key):
    """(steps, the mean over seeds at each) of one value of the training log lines."""
    by_step: dict[int, list] = {}
    for d in runs_:
        for r in d["train"]:
            if r.get(key) is not None:
                by_step.setdefault(r["step"], []).append(r[key])
    xs = sorted(by_step)
    return xs, [statistics.mean(by_step[s]) for s in xs]


def legend(fig, axes):
    """One legend for the figure, every line of every panel once (a baseline is drawn on its own task's panels
    only, so a legend of one panel would leave the other baselines out)."""
    seen = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), fontsize=7, ncol=min(4, max(1, len(seen))), loc="lower center")
    fig.tight_layout(rect=(0, 0.06 + 0.03 * ((len(seen) - 1) // 4), 1, 1))


def _save(plt, fig, path: str) -> str:
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def metric_plots(plt, specs: list, data: dict, labels: list[str], colour: dict, out: str) -> list[str]:
    """metrics_vs_step.png and metrics_vs_wall.png: each validation metric, a panel each, mean and 95% band over
    seeds per method, and its task's single-task baseline dashed."""
    paths = []
    for x, unit in (("step", "optimizer step"), ("wall", "wall time since start (s)")):
        fig, axes = plt.subplots(1, len(specs), figsize=(5 * len(specs), 4), squeeze=False)
        axes = axes[0]
        for ax, (key, task, _) in zip(axes, specs):
            for m in labels + [f"single_{task}"]:
                if m in data:
                    xs, ys, cis = mean_curve(data[m], key, x)
                    ax.plot(xs, ys, label=m, color=colour[m], ls="--" if m.startswith("single") else "-")
                    ax.fill_between(xs, [y - c for y, c in zip(ys, cis)], [y + c for y, c in zip(ys, cis)],
                                    color=colour[m], alpha=0.15, lw=0)
            ax.set_xlabel(unit)
            ax.set_ylabel(f"validation {key} (mean, 95% band over seeds)")
            ax.set_title(key)
        legend(fig, axes)
        paths.append(_save(plt, fig, os.path.join(out, f"metrics_vs_{x}.png")))
    return paths


def weight_plot(plt, tasks: list[str], data: dict, labels: list[str], colour: dict, out: str) -> str:
    """task_weights.png: each task's loss weight per method (mean over seeds), a panel per task."""
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    axes = axes[0]
    for ax, t in zip(axes, tasks):
        for m in labels:
            xs, ys = train_curve(data[m], f"weight_{t}")
            ax.plot(xs, ys, label=m, color=colour[m])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"loss weight of {t} (mean over seeds)")
        ax.set_title(f"weight_{t}")
    axes[-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(plt, fig, os.path.join(out, "task_weights.png"))


def cosine_plot(plt, tasks: list[str], data: dict, labels: list[str], colour: dict, out: str) -> str | None:
    """gradient_cosine.png: the cosine between each pair of tasks' gradients (of the shared parameters, and of the
    features where the runs logged it), a panel per pair; None with one task."""
    pairs = [(a, b) for i, a in enumerate(tasks) for b in tasks[i + 1:]]
    if not pairs:
        return None
    fig, axes = plt.subplots(1, len(pairs), figsize=(7 * len(pairs), 4), squeeze=False)
    for ax, (a, b) in zip(axes[0], pairs):
        for m in labels:
            for key, what in ((f"grad_cos/{a}_{b}", "shared parameters"), (f"feat_grad_cos/{a}_{b}", "features")):
                xs, ys = train_curve(data[m], key)
                if xs:
                    ax.plot(xs, ys, label=f"{m} ({what})", color=colour[m], ls="-" if what.startswith("shared")
                            else ":")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"cosine(grad {a}, grad {b})")
        ax.set_title(f"gradient conflict {a} / {b} (mean over seeds)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return _save(plt, fig, os.path.join(out, "gradient_cosine.png"))
