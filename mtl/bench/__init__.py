"""The task-weighting benchmark as a library (``python -m mtl.tools.bench`` is its command line): the sweep's plan,
runs, results and tables, its options, design and statistics, each run's record, the comparisons with numbers from
elsewhere, the launchers (local processes, Slurm), the plots, the toy problem and the gradient doctor's measurements.
It imports the layers below it (the run, its setup, the plug-ins) and never mtl.tools."""
