"""mtl: multi-task training in PyTorch. One shared backbone and one head per task, each a plug-in file found by name
(built in: torchvision CNN backbones; classification, captioning and counting heads), trained in one
process or under DDP or FSDP2 (``parallel.engine``), with AMP. A step strategy decides how the tasks' backward
passes meet the data-parallel engine, and a task-weighting method (loss-level, gradient-level or bilevel) how the
tasks' losses or gradients are combined; both are picked by name in the config. docs/architecture.md maps the
modules."""

__version__ = "0.1.0"

# ------------------------------------------------------------------ modules that moved
# {old dotted name: new dotted name}. An old name still imports for one release, as the very module of its new name
# (so its classes and functions are the same objects), with a DeprecationWarning saying where it went. Add a line
# here when a module moves; the test of the moved names (tests/test_layout.py) imports each one.
MOVED: dict[str, str] = {
    "mtl.plateau": "mtl.optim.plateau",
    "mtl.optim_groups": "mtl.optim.layer_groups",
    "mtl.plots": "mtl.run.plots",
    "mtl.tools.bench.options": "mtl.bench.options",
    "mtl.tools.bench.entries": "mtl.bench.entries",
    "mtl.tools.bench.compare": "mtl.bench.compare",
    "mtl.tools.bench.stats": "mtl.bench.stats",
    "mtl.tools.bench.record": "mtl.bench.record",
    "mtl.tools.bench.launch": "mtl.bench.launch",
    "mtl.tools.bench.lock": "mtl.bench.lock",
    "mtl.tools.bench.progress": "mtl.bench.progress",
    "mtl.tools.bench.design": "mtl.bench.design",
    "mtl.tools.bench.plots": "mtl.bench.plots",
    "mtl.tools.bench.toy_problem": "mtl.bench.toy_problem",
    "mtl.run.checkpoint": "mtl.checkpoint.folder",
    "mtl.run.train_state": "mtl.checkpoint.train_state",
    "mtl.run.finite": "mtl.checkpoint.finite",
    "mtl.build": "mtl.setup.build",
    "mtl.config.checks": "mtl.setup.checks",
    "mtl.config.reads": "mtl.setup.reads",
    "mtl.config.resume": "mtl.setup.resume",
    "mtl.config.multi_input": "mtl.setup.multi_input",
    "mtl.interop": "mtl.inference.interop",
}


def _install_moved_names() -> None:
    import importlib
    import importlib.abc
    import importlib.util
    import sys
    import warnings

    class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Finds a moved module by its old name; loading it puts the new module in its place in ``sys.modules``."""

        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, self) if name in MOVED else None

        def exec_module(self, module):
            name = module.__name__
            warnings.warn(f"{name} moved to {MOVED[name]}; the old name works until the next release",
                          DeprecationWarning, stacklevel=2)
            sys.modules[name] = importlib.import_module(MOVED[name])  # the import system returns this one

    if not any(type(f).__name__ == "MovedModules" for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())


_install_moved_names()
