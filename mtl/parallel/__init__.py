"""Parallelism: processes, DDP and FSDP2, mixed precision, and the checks that the ranks agree."""
