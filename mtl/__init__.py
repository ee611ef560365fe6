"""mtl: multi-task training in PyTorch. One shared backbone and one head per task, each a plug-in file found by name
(built in: torchvision CNN backbones; classification, captioning and counting heads), trained in one
process or under DDP or FSDP2 (``parallel.engine``), with AMP. A step strategy decides how the tasks' backward
passes meet the data-parallel engine, and a task-weighting method (loss-level, gradient-level or bilevel) how the
tasks' losses or gradients are combined; both are picked by name in the config. docs/architecture.md maps the
modules."""

__version__ = "0.1.0"
