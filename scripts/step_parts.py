"""Where `equal`'s step time goes beside LibMTL's: our step with each of its extras switched off.

    python scripts/step_parts.py [--sweeps 200] [--libmtl-path DIRS | --no-libmtl] [--out FILE]

`equal` only: it is the loss-level method LibMTL has (EW), and the one whose plain PyTorch step (the control
below) is the losses' plain sum; another method's plain step would be another objective.

One process, one trainer (``scripts/memory_per_method.py``'s: ``configs/default.yaml``'s model, a batch of 8, the
CPU, one thread, ``feature_leaf``), and these steps on the same 5 batches, one step each in turn, the order rotated
every sweep (so that no variant always follows the same one), after 3 warm-up steps each:

- ``libmtl``: LibMTL's EW step (``memory_per_method.libmtl_step``);
- ``plain``: the same step in plain PyTorch on our trainer (the losses' sum, one backward, ``clip_grad_norm_``,
  ``optimizer.step()``, ``scheduler.step()``, ``zero_grad``): LibMTL's step without LibMTL, the harness's control;
- ``ours``: ``Trainer.step_once``;
- ``ours - weights check``: without the weights' finiteness check after ``optimizer.step()`` (``params_finite``);
- ``ours, combined``: ``ddp.strategy=combined`` (one backward call) in place of ``feature_leaf`` (one per task,
  and one through the backbone);
- ``ours, combined - weights check``: both at once.

Our step is timed as a run takes it: ``feature_leaf``'s per-task feature-gradient norms and cosines are computed on
the steps the log writes only (the first and every ``trainer.log_every``: 10 here), so most steps here have none.

Each variant's step time is the wall time of the step; its ratio to the reference (``libmtl``, or ``plain`` with
``--no-libmtl``) is read per sweep, the two steps taken side by side, by ``ratio_test`` (geometric mean, its 95%
t-interval, and the one-sided tests "lower" and "within 5%"). A switch is a patch of one name for this process
only; each is checked to have taken effect (the patched function is not called, or the strategy is the one
asked for), and the script stops with a message if one has not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_per_method as mpm  # noqa: E402  (a sibling script: the trainer and LibMTL's step)

VARIANTS = ["libmtl", "plain", "ours", "ours - weights check", "ours, combined", "ours, combined - weights check"]


class Switches:
    """The extras of our step that a variant switches off, each a patch of one name for this process, undone on
    exit. With ``count``, the parts left on are wrapped to count their calls (``calls``), to check the switches."""

    def __init__(self, trainer):
        import mtl.run.step as step
        from mtl.strategies.combined import Combined

        self.trainer, self.step = trainer, step
        self.own = {"weights_check": step.params_finite, "strategy": trainer.parts.strategy}
        self.combined = Combined(trainer.cfg)
        self.calls = dict.fromkeys(("weights_check", "feature_leaf"), 0)

    def _counted(self, name, fn):
        def call(*a, **k):
            self.calls[name] += 1
            return fn(*a, **k)
        return call

    @contextlib.contextmanager
    def off(self, weights_check: bool = False, combined: bool = False, count: bool = False):
        own, strategy = self.own, self.own["strategy"]
        check = own["weights_check"]
        if count:
            check = self._counted("weights_check", check)
            strategy.forward_backward = self._counted("feature_leaf", type(strategy).forward_backward.__get__(strategy))
        self.step.params_finite = (lambda params, sharded: True) if weights_check else check
        self.trainer.parts.strategy = self.combined if combined else strategy
        try:
            yield
        finally:
            self.step.params_finite = own["weights_check"]
            self.trainer.parts.strategy = strategy
            strategy.__dict__.pop("forward_backward", None)


def plain_step(trainer):
    """LibMTL's EW step without LibMTL, on ``trainer``'s model, optimizer and scheduler: the losses' sum (``equal``),
    one backward, the same clipping, ``optimizer.step()``, the schedule."""
    import torch

    from mtl.parallel.dist import all_reduce_sum

    bare, tasks, clip = trainer.bare, list(trainer.parts.tasks), trainer.parts.grad_clip

    def step(batch):
        for t in tasks:
            bare.heads[t].prepare(batch, all_reduce_sum)
        losses = bare(batch)["losses"]
        trainer.optimizer.zero_grad(set_to_none=False)
        torch.stack([losses[t] for t in tasks]).sum().backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trainer.params, clip)
        trainer.optimizer.step()
        trainer.scheduler.step()

    return step


def steps(trainer, switches: Switches, with_libmtl: bool, method: str) -> dict:
    """Variant name -> a function of a batch that takes one step that way."""
    def ours(**off):
        def run(batch):
            with switches.off(**off):
                trainer.step_once(batch)
        return run

    out = {"libmtl": mpm.libmtl_step(trainer, method)} if with_libmtl else {}
    out.update({"plain": plain_step(trainer), "ours": trainer.step_once,  # nothing patched: as it is
                "ours - weights check": ours(weights_check=True), "ours, combined": ours(combined=True),
                "ours, combined - weights check": ours(weights_check=True, combined=True)})
    return out


def check_switches(trainer, switches: Switches, batch) -> None:
    """Each switch takes effect: with nothing off, each part runs once in a step; with one switch off, that part
    (the weights' check, ``feature_leaf`` itself) runs no time."""
    for off in (None, "weights_check", "combined"):
        switches.calls = dict.fromkeys(switches.calls, 0)
        with switches.off(**({off: True} if off else {}), count=True):
            trainer.step_once(batch)
        part = {"combined": "feature_leaf"}.get(off, off)
        wrong = {k: v for k, v in switches.calls.items() if v != 1} if off is None else \
            ({part: switches.calls[part]} if switches.calls[part] else {})
        if wrong:
            sys.exit(f"step_parts: {'with nothing off' if off is None else f'with {off} off'}, calls {wrong}: the "
                     "names this script patches have moved; fix Switches")


def measure(method: str, sweeps: int, with_libmtl: bool, out_dir: str) -> dict:
    """{variant: [step seconds, one per sweep]} in one process."""
    if with_libmtl:
        import LibMTL.weighting  # noqa: F401  imported before the build, as memory_per_method's processes do
    from mtl.run.evaluate import to_device

    trainer = mpm.build(method, out_dir, 8 + sweeps * len(VARIANTS) * 2)
    try:
        batches = trainer.batches()
        batch = [to_device(next(batches)[1], trainer.device) for _ in range(5)]
        switches = Switches(trainer)
        check_switches(trainer, switches, batch[0])
        run = steps(trainer, switches, with_libmtl, method)
        names = list(run)
        for name in names:
            for b in batch[:3]:
                run[name](b)
        times = {name: [] for name in names}
        for i in range(sweeps):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                b = batch[i % len(batch)]
                tic = time.perf_counter()
                run[name](b)
                times[name].append(time.perf_counter() - tic)
        return times
    finally:
        trainer.close()


def report(times: dict, reference: str) -> list[dict]:
    """Per variant: the median step time and its ratio to ``reference``'s, read per sweep by ``ratio_test``."""
    from mtl.bench.stats import ratio_test

    rows = []
    ref = times[reference]
    for name, t in times.items():
        test = ratio_test([a / b for a, b in zip(t, ref)])
        rows.append({"variant": name, "median_ms": statistics.median(t) * 1e3,
                     "extra_ms": statistics.median([a - b for a, b in zip(t, ref)]) * 1e3, **test})
    print(f"\n| step | median, ms | paired difference to `{reference}`, median ms | / `{reference}`, geometric mean "
          "[95% CI] | lower: p | within 5%: p |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["variant"] == reference:
            print(f"| `{r['variant']}` | {r['median_ms']:.1f} | (reference) | | | |")
            continue
        print(f"| `{r['variant']}` | {r['median_ms']:.1f} | {r['extra_ms']:+.2f} | {r['ratio']:.3f} "
              f"[{r['lo']:.3f}, {r['hi']:.3f}] | {r['p_lower']:.3g} | {r['p_within']:.3g} |")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", type=int, default=200, help="steps per variant, one of each per sweep")
    ap.add_argument("--libmtl-path", default=os.environ.get("LIBMTL_PATH", ""),
                    help="folders put in front of the path for LibMTL (default: $LIBMTL_PATH)")
    ap.add_argument("--no-libmtl", action="store_true", help="leave LibMTL's step out; `plain` is the reference")
    ap.add_argument("--out", help="write the step times and the table's rows as JSON here too")
    args = ap.parse_args(argv)
    if args.sweeps < 3:
        sys.exit("--sweeps: at least 3 (the ratios are read by a t-test)")
    with_libmtl = not args.no_libmtl
    if with_libmtl:
        why = mpm.libmtl_found(args.libmtl_path)
        if why is not None:
            print(f"LibMTL is not importable ({why}): give --libmtl-path (or LIBMTL_PATH) the folders that hold it, "
                  "or --no-libmtl to compare with the plain PyTorch step only.", file=sys.stderr)
            sys.exit(2)
        sys.path[:0] = [p for p in args.libmtl_path.split(os.pathsep) if p]
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        times = measure("equal", args.sweeps, with_libmtl, tmp)
    rows = report(times, "libmtl" if with_libmtl else "plain")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"method": "equal", "sweeps": args.sweeps, "rows": rows,
                       "times_s": times}, f, indent=1)


if __name__ == "__main__":
    main()
