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
It never starts a process group and writes nothing: it builds the run with ``mtl.setup.build.build_run_inputs``,
the trainer's own builder, which creates no output_dir, lock or checkpoint. The measurements are
``mtl/bench/doctor.py``'s (the benchmark reads its F and B); this file prints them.
"""

from __future__ import annotations

import json
import os
import sys

from mtl.bench.doctor import conflict_tests, examine, mean_ci95  # noqa: F401  (all three: this module's interface too)
from mtl.run.error_report import run_guarded
from mtl.setup.checks import load_run_config
from mtl.tools import tool_parser


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
