"""Pictures of a run: loss and metric curves from metrics.jsonl, and sample captions over their images."""

from __future__ import annotations

import io
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def curves_png(metrics_path: str, metric_keys: list[str]) -> bytes:
    """Per-task training losses (left) and the validation metrics ``metric_keys`` (right) against the step, as PNG
    bytes: the caller writes them (mtl/run/step_log.py: atomically, a failure one warning)."""
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({k for r in train for k in r if k.startswith("loss_")}):
        pts = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], label=key)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("training loss (nats)")
    ax1.set_yscale("log")
    ax1.set_title("training losses")
    ax1.legend()
    values = []
    for key in metric_keys:  # every task's declared metrics (TaskHead.metric_keys), whatever the tasks are
        pts = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        values += [p[1] for p in pts]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("validation metric")
    if values and all(0.0 <= v <= 1.0 for v in values):
        ax2.set_ylim(0, 1.02)
    ax2.set_title("validation")
    ax2.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=100)
    finally:
        plt.close(fig)
    return buffer.getvalue()


def sample_figure(images, samples):
    """A row of validation images titled with the generated and the reference caption."""
    fig, axes = plt.subplots(1, len(images), figsize=(3 * len(images), 3.4), squeeze=False)
    for ax, img, (idx, hyp, ref) in zip(axes[0], images, samples):
        ax.imshow(img.permute(1, 2, 0).clamp(0, 1).numpy())
        ax.set_title(f"#{idx}\npred: {hyp}\nref: {ref}", fontsize=7)
        ax.axis("off")
    fig.tight_layout()
    return fig
