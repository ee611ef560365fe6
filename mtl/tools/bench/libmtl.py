"""Our expert architectures against LibMTL's own code, on the same model, side by side in one process.

    python -m mtl.tools.bench.libmtl [--steps 200] [--warmup 20]

LibMTL (1.1.5, the dev extra) is the library the papers' tables come from. Its ``MMoE``, ``CGC`` and ``DSelect_k``
take any expert network (``encoder_class``) and any input, so they can be driven on our model: their input is our
backbone's features and their experts are ours (``mtl.architectures.experts.Expert``), the heads are the same
linear layers, and our weights are copied into theirs (``copy_weights``): two implementations of one model. Each
step is the whole training step of the part after the backbone (the backbone is the same module in both and only
dilutes the ratio): the architecture, a linear head per task, the equal-weighted sum of the tasks' MSE losses, one
backward pass and an AdamW step. The two are stepped in turn, each first every other round, so machine noise and
caches hit both alike; the table gives the median step of each, the ratio ours / LibMTL's, the peak memory of each
(``mtl.tools.bench.ved_step``'s measure) and both parameter counts.

The cases: the main job's features (a 128 x 4 x 4 map, K = 2, batch 32) and QM9's MPNN features (a 64-vector,
K = 11, batch 120). On a vector our model and LibMTL's are the same model (``tests/test_libmtl_architectures.py``
checks their outputs and gradients equal). On a map LibMTL's gates read the flattened map (C h w inputs) where ours
read its mean (C inputs), so its gates are larger: the row says so and the parameter counts differ by exactly that.
LibMTL's ``DSelect_k`` is given the binary codes it means (``intended_codes``: as it makes them, every code is all
ones) and runs in eval mode: in training mode its forward also back-propagates its entropy
regulariser (weight 1e-6), which ours does not apply (docs/sharing.md). Its smooth step always uses gamma = 1 (it
ignores ``kgamma``), so ours runs at gamma = 1 too.

LibMTL's MTAN, Cross-stitch and PLE cannot be driven on our model: they are written for a 4-stage torchvision
ResNet (``layer1`` .. ``layer4``) and differ from ours by design (docs/sharing.md says how).
"""

from __future__ import annotations

import statistics
import sys
import time
import types

import torch
import torchvision
from torch import nn

from mtl.architectures import architecture_types
from mtl.architectures.experts import Expert
from mtl.bench.step_memory import held_bytes, step_peak_bytes
from mtl.errors import ConfigError
from mtl.models.backbones.torchvision_cnn import build_torchvision_backbone
from mtl.run.error_report import run_guarded
from mtl.tools import tool_parser

# name: (our options, LibMTL's class, its kwargs from the task count)
DESIGNS = {
    "mmoe": (dict(experts=4), "MMoE", lambda k: dict(num_experts=[4])),
    "cgc": (dict(shared_experts=2, task_experts=1), "CGC", lambda k: dict(num_experts=[2] + [1] * k)),
    "dselect_k": (dict(experts=4, k=2, gamma=1.0), "DSelect_k",
                  lambda k: dict(num_experts=[4], num_nonzeros=2, kgamma=1.0)),
}
# (label, per-item feature shape, tasks, batch)
CASES = [("main job (resnet18, 2 stages)", (128, 4, 4), 2, 32), ("QM9's MPNN", (64,), 11, 120)]


def libmtl_architectures():
    """LibMTL's ``architecture`` package. LibMTL 1.1.5 imports ``torchvision.models.utils``, which torchvision removed
    in 0.13 (its one function moved to ``torch.hub``); that alias is all it is given."""
    if "torchvision.models.utils" not in sys.modules:
        shim = types.ModuleType("torchvision.models.utils")
        shim.load_state_dict_from_url = torch.hub.load_state_dict_from_url
        sys.modules["torchvision.models.utils"] = shim
    try:
        import LibMTL.architecture as arch
    except ImportError as e:
        raise ConfigError("this comparison needs LibMTL (the dev extra: pip install -c constraints.txt "
                          "-e '.[dev]', or make install)") from e
    return arch


class Ours(nn.Module):
    """Our architecture after an identity backbone: features -> {task: the tower's features}."""

    def __init__(self, name: str, tasks: list[str], feature_shape: tuple[int, ...], options: dict):
        super().__init__()
        a = architecture_types()[name]
        trunk, towers = a.build(nn.Identity(), tasks, feature_shape, a.Options(**options), None)
        self.trunk, self.towers = trunk, nn.ModuleDict(towers)

    def forward(self, f):
        shared = self.trunk(f)
        return {t: tower(shared) for t, tower in self.towers.items()}


def libmtl_model(name: str, tasks: list[str], feature_shape: tuple[int, ...]) -> nn.Module:
    """LibMTL's class of ``name`` with our experts over features of ``feature_shape``, identity decoders."""
    _, cls, kwargs = DESIGNS[name]
    c = feature_shape[0]
    model = getattr(libmtl_architectures(), cls)(
        task_name=list(tasks), encoder_class=lambda: Expert(c, c), decoders=nn.ModuleDict({t: nn.Identity() for t in tasks}),
        rep_grad=False, multi_input=False, device="cpu", img_size=list(feature_shape), **kwargs(len(tasks)))
    if name == "dselect_k":
        model._binary_codes = intended_codes(model)
    return model


def intended_codes(model) -> torch.Tensor:
    """The binary codes LibMTL's ``DSelect_k`` means: it makes them with ``astype(bool)`` on the digit strings "0" and
    "1", which NumPy >= 2 reads as all True (a non-empty string), so every expert would get the same code (NumPy 1.26
    parsed the digits as integers: these codes; docs/sharing.md). Its digits as integers, in its shape (1, E, m)."""
    e, m = model.num_experts, model._num_binary
    digits = [[int(b) for b in format(v, f"0{m}b")] for v in range(e)]
    return torch.tensor(digits, dtype=torch.bool).unsqueeze(0)


def pairs(name: str, ours: Ours, theirs: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(our module, LibMTL's module) holding the same weights, in one order."""
    out = list(zip(ours.trunk.experts, theirs.experts_shared))
    for t, tower in ours.towers.items():
        if name == "dselect_k":
            out += [(tower.gate.z, theirs._z_logits[t]), (tower.gate.alpha, theirs._w_logits[t])]
            continue
        out.append((tower.gate.linear, theirs.gate_specific[t][0]))
        if name == "cgc":
            out += list(zip(tower.experts, theirs.experts_specific[t]))
    return out


def copy_weights(name: str, ours: Ours, theirs: nn.Module) -> None:
    """Our weights into LibMTL's model (they must have the same shapes: the features are a vector)."""
    for mine, its in pairs(name, ours, theirs):
        its.load_state_dict(mine.state_dict())


class Step:
    """One training step of an architecture, a linear head per task, equal-weighted MSE losses and AdamW."""

    def __init__(self, arch: nn.Module, tasks: list[str], channels: int, heads: nn.ModuleDict | None = None):
        self.arch, self.tasks = arch, tasks
        self.heads = heads if heads is not None else nn.ModuleDict({t: nn.Linear(channels, 1) for t in tasks})
        self.params = [*arch.parameters(), *self.heads.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3)

    def __call__(self, batch):
        f, y = batch
        out = self.arch(f)
        loss = sum(nn.functional.mse_loss(self.heads[t](out[t].flatten(2).mean(-1) if out[t].dim() > 2 else out[t]),
                                          y[:, i:i + 1]) for i, t in enumerate(self.tasks))
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.optimizer.step()

    def held(self) -> int:
        return held_bytes([self.arch, self.heads], self.optimizer)


def build(name: str, feature_shape: tuple[int, ...], k: int, seed: int = 0) -> tuple[Step, Step, bool]:
    """(our step, LibMTL's step, whether they are the same model), the heads equal."""
    tasks = [f"t{i}" for i in range(k)]
    torch.manual_seed(seed)
    ours = Ours(name, tasks, feature_shape, DESIGNS[name][0])
    theirs = libmtl_model(name, tasks, feature_shape)
    same = len(feature_shape) == 1
    if same:
        copy_weights(name, ours, theirs)
    if name == "dselect_k":
        theirs.eval()  # its training-mode forward back-propagates the entropy regulariser, which ours does not apply
    mine = Step(ours, tasks, feature_shape[0])
    heads = nn.ModuleDict({t: nn.Linear(feature_shape[0], 1) for t in tasks})
    heads.load_state_dict(mine.heads.state_dict())
    return mine, Step(theirs, tasks, feature_shape[0], heads), same


def measure(steps: int, warmup: int, names=tuple(DESIGNS)) -> list[dict]:
    rows = []
    for label, shape, k, b in CASES:
        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(b, *shape, generator=g), torch.randn(b, k, generator=g))
        for name in names:
            mine, theirs, same = build(name, shape, k)
            times = {"ours": [], "libmtl": []}
            for r in range(warmup + steps):
                order = (("ours", mine), ("libmtl", theirs))
                for who, step in order[::1 if r % 2 else -1]:  # each goes first every other round
                    tic = time.perf_counter()
                    step(batch)
                    if r >= warmup:
                        times[who].append(time.perf_counter() - tic)
            med = {who: statistics.median(t) for who, t in times.items()}
            mem = {who: step_peak_bytes(s, batch, s.held) for who, s in (("ours", mine), ("libmtl", theirs))}
            count = {who: sum(p.numel() for p in s.arch.parameters()) for who, s in (("ours", mine), ("libmtl", theirs))}
            rows.append(dict(case=label, shape=shape, k=k, batch=b, name=name, same=same, med=med, mem=mem,
                             params=count))
    return rows


def encoder_counts(tasks: int = 2, image: int = 64) -> list[tuple[str, int, int]]:
    """(architecture, our parameters, LibMTL's) for MTAN, Cross-stitch and PLE on one encoder, a torchvision
    ResNet-18 with its 4 stages, ``tasks`` tasks: different designs (docs/sharing.md), counted on the same encoder.
    The heads are left out of both; LibMTL's parts of the ResNet are those it runs (not its ``fc``). PLE at each
    one's defaults: ours 2 levels of 2 shared and 1 task expert on the features; LibMTL's experts are whole ResNets
    (1 shared and 1 per task here, its smallest), with a gate on the flattened input of each of its 5 levels."""
    arch, names = libmtl_architectures(), [f"t{i}" for i in range(tasks)]
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(image_size=image))
    out = []
    extra = {"PLE": dict(img_size=[3, image, image], num_experts=[1] * (tasks + 1))}
    for name, cls in (("mtan", "MTAN"), ("cross_stitch", "Cross_stitch"), ("ple", "PLE")):
        ours_type = architecture_types()[name]
        backbone = build_torchvision_backbone("resnet18", None, norm="batch", stages=4)
        trunk, towers = ours_type.build(backbone, names, (512, image // 32, image // 32), ours_type.Options(), cfg)
        ours = sum(p.numel() for m in (trunk, *towers.values()) for p in m.parameters())

        def resnet():
            net = torchvision.models.resnet18()
            net.feature_dim = 512  # what LibMTL's MTAN reads to tell a BasicBlock ResNet from a Bottleneck one
            return net

        theirs = getattr(arch, cls)(task_name=names, encoder_class=resnet, decoders=nn.ModuleDict(), rep_grad=False,
                                    multi_input=False, device="cpu", **extra.get(cls, {}))
        out.append((name, ours, sum(p.numel() for p in theirs.encoder.parameters())))
    return out


def table(rows: list[dict], steps: int, warmup: int) -> str:
    out = [f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); median of {steps} alternated steps "
           f"after {warmup}",
           "| features | K | architecture | same model | step, ours (ms) | LibMTL's (ms) | time ours / LibMTL | "
           "peak memory ours / LibMTL | parameters, ours | LibMTL's |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        same = "yes" if r["same"] else "no: its gates read the flattened map"
        out.append(f"| {r['case']} {'x'.join(map(str, r['shape']))}, batch {r['batch']} | {r['k']} | {r['name']} | "
                   f"{same} | {1000 * r['med']['ours']:.3f} | {1000 * r['med']['libmtl']:.3f} | "
                   f"{r['med']['ours'] / r['med']['libmtl']:.2f}x | {r['mem']['ours'] / r['mem']['libmtl']:.2f}x | "
                   f"{r['params']['ours']:,} | {r['params']['libmtl']:,} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = tool_parser("mtl.tools.bench.libmtl", __doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--architectures", nargs="+", default=list(DESIGNS), choices=list(DESIGNS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    def go():
        print(table(measure(args.steps, args.warmup, args.architectures), args.steps, args.warmup))
        print("\nOn one encoder (a torchvision ResNet-18, 4 stages, K = 2, 64 px), heads left out:\n"
              "| architecture | parameters, ours | LibMTL's |\n|---|---:|---:|")
        for name, ours, theirs in encoder_counts():
            print(f"| {name} | {ours:,} | {theirs:,} |")

    return run_guarded(go)  # LibMTL missing: one message naming it, exit 2


if __name__ == "__main__":
    sys.exit(main())
