"""The gradient doctor's measurements (``python -m mtl.tools.doctor`` prints them; the sweep reads its F and B): one
step in one process, built with ``mtl.setup.build.build_run_inputs`` (the trainer's own builder, which creates no
output_dir, lock or checkpoint), and never a process group.

- per task, which module groups receive a gradient (non-zero, zero, or none), on the first batch;
- per-task gradient norms, and any NaN/inf with the parameter names;
- the cosine between the tasks' gradients on the shared (backbone) parameters, over several training batches: its
  mean and a 95% confidence interval (Student's t over the batches), tested against 0 with Holm's correction across
  the task pairs;
- per strategy: forwards, backbone backward passes, all-reduces and bytes all-reduced per step, the extra memory held
  (each strategy states these itself), and a time estimate from the measured forward/backward times;
- a recommendation for this model, with the reason.
"""

from __future__ import annotations

import time

import torch

from mtl.bench.stats import holm, mean_ci, paired_test
from mtl.parallel.gradient_reach import nonfinite_parameters, reach_table, task_gradients
from mtl.setup.build import build_run_inputs, init_from_weights, run_method_types
from mtl.strategies import strategy_types


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


def gradient_cosines(model, stream, grads: dict, tasks: list[str], batches: int) -> dict:
    """``{"a/b": {mean, ci95, batches, per_batch, p, p_holm, conflict}}``: the cosine between each pair of tasks'
    gradients of the shared parameters, on ``grads`` (the first batch's) and the next ``batches - 1`` of
    ``stream``."""
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
    return cosine


def step_times(model, batch) -> tuple[float, float]:
    """(F, B): the measured forward and backward times of the whole model on ``batch`` (the best of 3)."""
    def forward():
        return sum(model(batch)["losses"].values())

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        forward().backward()

    f_time = _timed(lambda: forward().detach())
    fb_time = _timed(fwd_bwd)
    model.zero_grad(set_to_none=True)
    return f_time, max(fb_time - f_time, 1e-9)


def step_goals(model, batch, reps: int = 10) -> list[float]:
    """``reps`` independent measurements of the step-time goal (F + 2B) / (F + B) of gradient-level methods on the
    parameters (F, B: ``step_times``, each the best of 3): one measurement moves by 15% between runs minutes apart on
    a shared machine, so the goal is reported as an interval over these (``stats.mean_ci``)."""
    out = []
    for _ in range(reps):
        f, b = step_times(model, batch)
        out.append((f + 2 * b) / (f + b))
    return out


def strategy_costs(model, batch, k: int, f_time: float, b_time: float) -> tuple[dict, dict]:
    """(the parameter counts ``{all, shared, heads}``, per safe strategy its cost for this model: what it states of
    itself, the bytes it all-reduces and the memory it holds, and its time estimate from F and B)."""
    p_all = sum(p.numel() for p in model.parameters() if p.requires_grad)
    p_shared = sum(p.numel() for p in model.backbone.parameters() if p.requires_grad)
    p_heads = p_all - p_shared
    elem = 4
    with torch.no_grad():
        fmap = model.backbone(batch[getattr(model.backbone, "consumes", "image")]).numel()  # the shared features
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
    return {"all": p_all, "shared": p_shared, "heads": p_heads}, costs


def recommendation(cfg, cosine: dict, costs: dict) -> tuple[str, str]:
    """(the strategy to use, why). It suggests a gradient-level method only when the conflict is significant (a
    negative mean cosine whose t-test survives Holm's correction across the task pairs; with two tasks, the whole 95%
    interval below zero), and says what it costs."""
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
    return rec


def examine(cfg, batches: int = 8, goal_reps: int = 0) -> dict:
    """The doctor's report of ``cfg``'s model (its initial weights, or ``init_from``'s), on ``batches`` training
    batches: the reach, norms, non-finite gradients, cosines, F and B, parameter counts, strategy costs and the
    recommendation; with ``goal_reps``, that many measurements of the step-time goal (``step_goals``)."""
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
    cosine = gradient_cosines(model, stream, grads, tasks, batches)
    f_time, b_time = step_times(model, batch)  # measured forward and backward times of the whole model (F, B)
    params, costs = strategy_costs(model, batch, len(tasks), f_time, b_time)
    rec = recommendation(cfg, cosine, costs)
    return {"batch_size": cfg.data.batch_size, "tasks": tasks, "reach": table, "grad_norms": norms,
            "nonfinite": nonfinite, "cosine": cosine, "forward_s": f_time, "backward_s": b_time,
            "params": params, "strategies": costs, "recommendation": {"strategy": rec[0], "reason": rec[1]},
            "step_goals": step_goals(model, batch, goal_reps) if goal_reps else []}
