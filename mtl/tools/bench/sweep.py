"""``python -m mtl.tools.bench.sweep``: the weighting benchmark's command line, the same as ``python -m
mtl.tools.bench`` (its main: mtl/bench/sweep.py).

The sweep's library moved to mtl/bench/ in parts: regimes.py (the methods, regimes and plan), runs.py (training
them), results.py (reading them back: Δm, tests, convergence, cost), tables.py (results.md, the CSVs, hparams) and
sweep.py (the command line). Its names still import from here for one release, with a DeprecationWarning."""

import sys
import warnings

from mtl.bench.entries import method_spec, parse_method  # noqa: F401
from mtl.bench.regimes import (  # noqa: F401
    LAUNCHERS,
    REGIME_KEYS,
    _flat,
    architecture_regimes,
    bench_errors,
    describe_plan,
    describe_protocol,
    heldout_for,
    list_runs,
    method_errors,
    method_overrides,
    plan,
    plateau_baselines_of,
    regime_configs,
    regimes,
    run_folder,
    strategy_for,
)
from mtl.bench.results import (  # noqa: F401
    _run_dir,
    _trained_steps,
    adjust,
    allreduce_bytes,
    converged,
    detectable,
    meta_cost_note,
    per_seed,
    read_regime,
    read_run,
    regime_effects,
    report_split,
    select,
    summarize,
)
from mtl.bench.runs import _drive, earlier_attempt, launch_threads, run_all, run_command, run_threads, train_script  # noqa: F401
from mtl.bench.sweep import HELP, PRESETS, main, sweep  # noqa: F401
from mtl.bench.tables import (  # noqa: F401
    CSV_FIXED,
    CSV_TAIL,
    MARK,
    _interval,
    _not_ok_note,
    _pm,
    detectable_lead,
    effects_table,
    eval_window,
    finished_runs,
    quality_sentence,
    reference_sentence,
    regime_table,
    test_sentence,
    write_hparams,
    write_results,
)
from mtl.delta_m import delta, metric_specs  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())  # main's exit code: 2 on a config error or an --on-change refuse
else:
    warnings.warn("mtl.tools.bench.sweep's names moved to mtl.bench (regimes, runs, results, tables, sweep); the old "
                  "name works until the next release", DeprecationWarning, stacklevel=2)
