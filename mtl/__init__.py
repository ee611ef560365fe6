"""mtl: multi-task training in PyTorch. One shared backbone and one head per task (built in: classification,
captioning, counting; more as plug-in files), one backward pass per task under DDP or FSDP2 with AMP, step
strategies and task-weighting methods picked in the config. docs/architecture.md maps the modules."""

__version__ = "0.1.0"
