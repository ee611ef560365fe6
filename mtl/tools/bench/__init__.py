"""The weighting benchmark: sweeps, their statistics, plots and launchers; the toy problem; the strategy benchmark."""
