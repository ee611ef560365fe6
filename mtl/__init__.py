"""mtl: multi-task training (one backbone, a classification and a captioning head) under DDP."""

__version__ = "0.1.0"
