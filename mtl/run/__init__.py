"""A run: the trainer, its step, checkpoints, logging, evaluation and the faults it survives."""
