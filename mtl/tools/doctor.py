"""The gradient doctor: one step in one process, and what each strategy would cost.

    python -m mtl.tools.doctor --config configs/tiny.yaml [--batches 8] [key=value ...] [--json]

Prints, for the configured model (its initial weights, or a trained model's with
``init_from=<checkpoint>``):
- per task, which module groups receive a gradient (non-zero, zero, or none), on the first batch;
- per-task gradient norms, and any NaN/inf with the parameter names;
- the cosine between the tasks' gradients on the shared (backbone) parameters, on ``--batches``
  training batches: its mean and a 95% confidence interval (Student's t over the batches);
- per strategy: forwards, backbone backward passes, all-reduces and bytes all-reduced per step, the
  extra memory held (each strategy states these itself), and a time estimate from measured
  forward/backward times;
- a recommendation for this model, with the reason. It suggests a gradient-level method only when
  the conflict is significant (a negative mean cosine whose t-test survives Holm's correction across the task
  pairs; with two tasks, the whole 95% interval below zero), and says what it costs.
It never starts a process group and writes nothing: it builds the run with ``mtl.build.build_run_inputs``,
the trainer's own builder, which creates no output_dir, lock or checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from mtl.build import build_run_inputs, init_from_weights, run_method_types
from mtl.config.checks import load_run_config
from mtl.parallel.gradient_reach import nonfinite_parameters, reach_table, task_gradients
from mtl.run.error_report import run_guarded
from mtl.strategies import strategy_types
from mtl.tools import tool_parser
from mtl.tools.bench.stats import holm, mean_ci, paired_test


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval of the mean); half-width inf for one value."""
    mean, half = mean_ci(values)
    return mean, float("inf") if half != half else half


def conflict_tests(cosine: dict, alpha: float = 0.05) -> None:
    """Per task pair: ``p`` (the two-sided t-test of its mean cosine over the batches against 0) and ``p_holm``
    (Holm's correction across the K(K-1)/2 pairs, 55 at K = 11: the smallest of many means is not evidence by
    itself), and ``conflict``: the mean is below 0 and ``p_holm`` < alpha. With one pair this is its 95%
    interval lying below 0. Fewer than 3 batches: p is nan, no conflict."""
    for c in cosine.values():
        c["p"] = paired_test(c["per_batch"], alpha)["p"] if len(c["per_batch"]) >= 3 else float("nan")
    for c, p in zip(cosine.values(), holm([c["p"] for c in cosine.values()])):
        c["p_holm"] = p
        c["conflict"] = bool(c["mean"] < 0 and p < alpha)


def _timed(fn, reps: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - tic)
    return best


def examine(cfg, batches: int = 8) -> dict:
    run = build_run_inputs(cfg)  # the run's own data, tokenizer, model and collate; read-only (no output_dir)
    model = run.model.train()
    if cfg.get("init_from"):
        init_from_weights(model, cfg.init_from)
    stream = iter(run.train_loader())
    batch = next(stream)
    tasks = list(cfg.tasks)

    grads = task_gradients(model, batch, tasks)
    table = reach_table(grads, depth=3)
    norms = {t: float(torch.linalg.vector_norm(torch.stack([g.norm() for g in per.values() if g is not None])))
             for t, per in grads.items()}
    nonfinite = {t: nonfinite_parameters(per) for t, per in grads.items()}
    shared_names = [n for n, p in model.named_parameters() if n.startswith("backbone.") and p.requires_grad]

    pairs = [(a, b) for i, a in enumerate(tasks) for b in tasks[i + 1:]]
    per_batch: dict[str, list[float]] = {f"{a}/{b}": [] for a, b in pairs}
    for n in range(batches):  # one batch says little: the cosine's spread over batches is as large as its mean
        if n:
            batch_n = next(stream, None)
            if batch_n is None:
                break
            grads_n = task_gradients(model, batch_n, tasks)
        else:
            grads_n = grads
        vecs = {t: torch.cat([(grads_n[t][name] if grads_n[t][name] is not None
                               else torch.zeros_like(dict(model.named_parameters())[name])).reshape(-1)
                              for name in shared_names]) for t in tasks}
        for a, b in pairs:
            per_batch[f"{a}/{b}"].append(float(torch.nn.functional.cosine_similarity(vecs[a], vecs[b], dim=0)))
    cosine = {}
    for key, values in per_batch.items():
        mean, half = mean_ci95(values)
        cosine[key] = {"mean": mean, "ci95": half, "batches": len(values), "per_batch": values}
    conflict_tests(cosine)

    # measured forward and backward times of the whole model (F, B), and of the backbone alone
    def forward():
        return sum(model(batch)["losses"].values())

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        forward().backward()

    f_time = _timed(lambda: forward().detach())
    fb_time = _timed(fwd_bwd)
    b_time = max(fb_time - f_time, 1e-9)
    model.zero_grad(set_to_none=True)

    p_all = sum(p.numel() for p in model.parameters() if p.requires_grad)
    p_shared = sum(p.numel() for p in model.backbone.parameters() if p.requires_grad)
    p_heads = p_all - p_shared
    elem = 4
    with torch.no_grad():
        fmap = model.backbone(batch[getattr(model.backbone, "consumes", "image")]).numel()  # the shared features
    k = len(tasks)
    costs = {}
    for name, cls in strategy_types().items():
        if cls.unsafe:
            continue
        c = cls.cost(k)
        extra = cls.extra_memory_bytes(k, p_shared, fmap, elem)
        reduced = cls.allreduce_bytes(k, p_shared, p_heads, elem)
        # time model: each forward costs F; each backbone backward costs about B (heads are small here)
        estimate = (c["forwards"] * f_time + c["backbone_backwards"] * b_time) / (f_time + b_time)
        costs[name] = {**c, "bytes_allreduced": reduced, "extra_memory_bytes": extra,
                       "est_time_vs_combined": round(estimate, 2), "exact_combined_gradient": not cls.changes_objective,
                       "task_gradients": cls.task_gradients, "summary": cls.summary}
    method = run_method_types(cfg)[cfg.weighting.method]
    if method.level == "grad":
        rec = ("task_grads", f"weighting.method={cfg.weighting.method} needs each task's rank-averaged gradient of the "
               "shared parameters; task_grads gives it with one backbone forward and one all-reduce")
    else:
        rec = ("feature_leaf", "it gives the exact combined-loss gradient with one backbone forward, one backbone "
               "backward and one all-reduce (the cost of combined), plus each task's feature gradient")
    if method.level == "loss" and cosine:
        key = min(cosine, key=lambda k: cosine[k]["mean"])
        c = cosine[key]
        measured = (f"cosine({key}) {c['mean']:+.3f} ± {c['ci95']:.3f} (95% CI over {c['batches']} batches)"
                    + (f", p {c['p_holm']:.2g} after Holm's correction across the {len(cosine)} task pairs"
                       if len(cosine) > 1 and c["p_holm"] == c["p_holm"] else ""))
        extra = costs["task_grads"]["est_time_vs_combined"] / max(costs["feature_leaf"]["est_time_vs_combined"], 1e-9)
        if c["conflict"]:
            rec = (rec[0], rec[1] + f"; the tasks' shared gradients conflict significantly ({measured}), so a "
                   "gradient-level method (pcgrad, mgda, cagrad, nashmtl ...) with ddp.strategy=task_grads may be "
                   f"worth a try: its step costs about {extra:.2f}x this one here (estimated from the measured F and "
                   "B, before the method's own maths), or with weighting.source=features on feature_leaf at about "
                   "this step's cost (a surrogate: the gradients of the shared features); whether either pays off "
                   "in quality is what `make bench` measures")
        else:
            rec = (rec[0], rec[1] + f"; no significant gradient conflict ({measured}): nothing here argues for a "
                   "gradient-level method")
    return {"batch_size": cfg.data.batch_size, "tasks": tasks, "reach": table, "grad_norms": norms,
            "nonfinite": nonfinite, "cosine": cosine, "forward_s": f_time, "backward_s": b_time,
            "params": {"all": p_all, "shared": p_shared, "heads": p_heads}, "strategies": costs,
            "recommendation": {"strategy": rec[0], "reason": rec[1]}}


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MB"


def render(report: dict) -> str:
    out = [f"gradient doctor: one step in one process, batch {report['batch_size']}", ""]
    out.append("where each task's gradient goes (module group: non-zero | zero | none)")
    groups = sorted({g for row in report["reach"].values() for g in row})
    tasks = report["tasks"]
    width = max(len(g) for g in groups) + 2
    out.append("  " + "group".ljust(width) + "".join(t.ljust(10) for t in tasks))
    for g in groups:
        out.append("  " + g.ljust(width) + "".join(report["reach"][t].get(g, "-").ljust(10) for t in tasks))
    out.append("")
    out.append("per-task gradient norm: " + ", ".join(f"{t}={v:.4g}" for t, v in report["grad_norms"].items()))
    bad = {t: v for t, v in report["nonfinite"].items() if v}
    out.append("non-finite gradients: " + ("; ".join(f"{t}: {', '.join(v[:5])}" for t, v in bad.items()) or "none"))
    many = len(report["cosine"]) > 1
    out.append("gradient conflict on the shared parameters (cosine, mean ± 95% CI over batches"
               + (", p after Holm across the pairs" if many else "") + "): "
               + ", ".join(f"{k}={v['mean']:+.3f} ± {v['ci95']:.3f} ({v['batches']} batches"
                           + (f", p {v['p_holm']:.2g}" if many else "") + ")" + (" conflict" if v["conflict"] else "")
                           for k, v in report["cosine"].items()))
    p = report["params"]
    out.append(f"parameters: {p['all']:,} ({p['shared']:,} shared, {p['heads']:,} in heads); measured "
               f"F={report['forward_s'] * 1e3:.1f} ms, B={report['backward_s'] * 1e3:.1f} ms")
    out.append("")
    out.append("what each strategy costs per step (time estimate = (forwards*F + backbone backwards*B) / (F+B))")
    hdr = f"  {'strategy':<13}{'fwd':>4}{'bb bwd':>7}{'all-red':>8}{'bytes reduced':>15}{'extra mem':>12}{'time':>7}  exact"
    out.append(hdr)
    for name, c in report["strategies"].items():
        out.append(f"  {name:<13}{c['forwards']:>4}{c['backbone_backwards']:>7}{c['allreduces']:>8}"
                   f"{_mb(c['bytes_allreduced']):>15}{_mb(c['extra_memory_bytes']):>12}{c['est_time_vs_combined']:>6}x"
                   f"  {'yes' if c['exact_combined_gradient'] else 'no (detached objective)'}")
    r = report["recommendation"]
    out += ["", f"recommendation: ddp.strategy={r['strategy']}: {r['reason']}"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("mtl.tools.doctor", __doc__, overrides="key=value config overrides")
    parser.add_argument("--config", required=True, help="the run's config")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--batches", type=int, default=8, help="training batches to measure the gradient conflict on")
    args = parser.parse_args(argv)
    for key in ("RANK", "WORLD_SIZE"):
        os.environ.pop(key, None)  # one process, always

    def run():
        cfg = load_run_config(args.config, args.overrides)
        report = examine(cfg, max(1, args.batches))
        print(json.dumps(report, indent=2) if args.json else render(report))

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
