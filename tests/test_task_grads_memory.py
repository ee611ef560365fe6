"""The parameters source's memory (docs/strategies.md, "Memory of the parameters source"): each task's gradient is
written straight into its row of the K x P buffer, and the row methods with a K x P state keep it without further
K x P copies, with the same numbers as their pure functions."""

import weakref

import torch
from torch import nn

from mtl.strategies.task_grads import RowWriter
from mtl.weighting.base import all_finite
from mtl.weighting.dbmtl import dbmtl_average
from mtl.weighting.excessmtl import accumulate_squares_, excess_risks
from mtl.weighting.moco import moco_targets, moco_update

from .weighting_cases import close, make, random_grads


def test_a_row_is_the_gradient_written_in_place_one_parameter_at_a_time():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    unused = nn.Parameter(torch.randn(5))  # the features do not depend on it: a zero slice
    shared = [*net.parameters(), unused]
    features = net(torch.randn(2, 3, 12, 12))
    out_grad = torch.randn_like(features)
    expected = torch.autograd.grad(features, shared, out_grad, retain_graph=True, allow_unused=True,
                                   materialize_grads=True)
    row = torch.full((sum(p.numel() for p in shared),), float("nan"))
    seen, alive = [], []

    def watch(g):  # runs before RowWriter's own hook: how many earlier parameters' gradients still live
        alive.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(g))

    handles = [p.register_hook(watch) for p in shared]
    RowWriter(shared, row)(features, out_grad)
    for h in handles:
        h.remove()
    assert torch.equal(row, torch.cat([g.reshape(-1) for g in expected]))
    assert len(alive) == len(shared) - 1 and max(alive) == 0  # each gradient freed once copied: never a set of them
    assert all(p.grad is None for p in shared)  # .grad untouched: DDP's hooks would not fire
    assert all(not p._backward_hooks for p in shared[:1])  # its hooks are removed


def test_dbmtl_moves_its_average_in_place_with_the_pure_function_s_numbers():
    w = make("dbmtl")
    g, losses = random_grads(2, 50, 0), torch.tensor([1.5, 0.5], dtype=torch.float64)
    w.combine(g, losses)
    ptr, reference = w.average.data_ptr(), dbmtl_average(None, g, losses, 0.9)
    close(w.average, reference, 0)
    for step in range(1, 4):
        g = random_grads(2, 50, step)
        w.combine(g, losses)
        reference = dbmtl_average(reference, g, losses, 0.9)
        close(w.average, reference, 0)  # bit for bit
        assert w.average.data_ptr() == ptr  # the same storage: no new K x P average per step


def test_moco_forms_the_new_tracked_gradients_in_its_targets_with_the_pure_function_s_numbers():
    g, losses = random_grads(2, 50, 0), torch.tensor([1.5, 0.5], dtype=torch.float64)
    y, lam = moco_update(None, torch.full((2,), 0.5, dtype=torch.float64), moco_targets(g, losses), 0.5, 0.1, 0.0)
    h = moco_targets(random_grads(2, 50, 1), losses)
    expected = moco_update(y, lam, h, 0.3, 0.07, 0.0)
    y_before = y.clone()
    got = moco_update(y, lam, h, 0.3, 0.07, 0.0, out=h)
    assert got[0].data_ptr() == h.data_ptr()  # formed in h's storage
    close(got[0], expected[0], 0)
    close(got[1], expected[1], 0)
    close(y, y_before, 0)  # the tracked gradients it came from are left as they were


def test_excessmtl_moves_its_accumulator_in_place_with_the_out_of_place_numbers():
    w = make("excessmtl")
    g = random_grads(2, 50, 0)
    w.combine(g)
    ptr, reference = w.accum.data_ptr(), g * g
    for step in range(1, 4):
        g = random_grads(2, 50, step)
        d = w.combine(g)
        reference = reference + g * g
        close(w.accum, reference, 0)  # bit for bit
        assert w.accum.data_ptr() == ptr  # the same storage: no second K x P accumulator per step
    close(excess_risks(reference, g), (g * g / (reference + 1e-7).sqrt()).sum(1), 1e-12)  # row by row, same sums
    close(d, w.task_weights @ g, 0)


def test_the_in_place_accumulation_refuses_what_might_not_be_finite_and_leaves_the_state():
    big = torch.finfo(torch.float32).max
    for grads, accum in ((torch.tensor([[1.0, float("nan")]]), torch.ones(1, 2)),
                         (torch.tensor([[1.0, float("inf")]]), torch.ones(1, 2)),
                         (torch.tensor([[2e19, 0.0]]), torch.ones(1, 2)),  # its square overflows float32
                         (torch.tensor([[1.0, 0.0]]), torch.tensor([[big, 0.0]]))):  # S + 1 might
        before = accum.clone()
        assert not accumulate_squares_(accum, grads)
        assert torch.equal(accum, before)
    accum = torch.ones(1, 2)
    assert accumulate_squares_(accum, torch.tensor([[3.0, -2.0]])) and accum.tolist() == [[10.0, 5.0]]


def test_all_finite_sees_every_nan_and_inf_without_a_full_size_temporary():
    x = torch.zeros(3, 1000)
    assert all_finite(x) and all_finite(x[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[2, 777] = bad
        assert not all_finite(y)


def test_the_comparison_with_libmtl_says_so_when_libmtl_cannot_be_imported(tmp_path):
    import importlib.util
    import os
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("LibMTL") is not None:
        pytest.skip("LibMTL is importable in this environment: the script would measure")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "LIBMTL_PATH": str(tmp_path)}  # an empty folder: no LibMTL there (nor in mtl's environment)
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "memory_per_method.py"), "--libmtl",
                           "--methods", "pcgrad"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "LibMTL is not importable" in done.stderr and "nothing compared" in done.stderr
    assert "pcgrad" not in done.stdout  # nothing measured


def test_the_comparison_with_libmtl_reads_its_rounds_with_paired_tests(capsys):
    """The verdict table of scripts/memory_per_method.py on rounds with known ratios: a method lower every round is
    "lower", one at 1.0 +- 1% is "<= (within 5%)" but not lower, one 10% above is "not shown <="; Holm across the
    methods of each measure."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("memory_per_method", os.path.join(root, "scripts",
                                                                                     "memory_per_method.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ratios = {"pcgrad": [0.80, 0.82, 0.79, 0.81], "mgda": [1.00, 1.01, 0.99, 1.00], "equal": [1.10, 1.12, 1.09, 1.11]}
    rows = [{"round": i, "method": m, "memory_ratio": r[i], "time_ratio": r[i]} for m, r in ratios.items()
            for i in range(4)]
    out = {(v["measure"], v["method"]): v for v in script.verdicts(list(ratios), rows)}
    table = capsys.readouterr().out
    mem = {m: out[("memory growth", m)] for m in ratios}
    assert mem["pcgrad"]["p_lower_holm"] < 0.05 and mem["mgda"]["p_within_holm"] < 0.05 < mem["mgda"]["p_lower_holm"]
    assert mem["equal"]["p_within_holm"] > 0.05 and mem["equal"]["lo"] > 1
    assert "| memory growth | `pcgrad` | 4 |" in table and "| lower |" in table
    assert "<= (within 5%)" in table and "not shown <=" in table


def test_the_interleaved_step_times_are_a_third_measure_read_the_same_way(capsys):
    """With ``--interleaved`` each round also times both steps in one process; ``verdicts`` reads those ratios as a
    third measure, beside (not mixed into) the fresh processes' step times."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("memory_per_method", os.path.join(root, "scripts",
                                                                                     "memory_per_method.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fresh, mixed = [1.30, 0.90, 1.20, 1.10], [1.01, 0.99, 1.00, 1.00]
    rows = [{"round": i, "method": "equal", "memory_ratio": 1.0, "time_ratio": fresh[i], "interleaved_ratio": mixed[i]}
            for i in range(4)]
    out = {v["measure"]: v for v in script.verdicts(["equal"], rows)}
    assert set(out) == {"memory growth", "step time (median)", "step time, one process interleaved"}
    assert out["step time, one process interleaved"]["p_within_holm"] < 0.05  # within 5%, from its own rounds
    assert out["step time (median)"]["p_within_holm"] > 0.05  # the fresh processes' scatter shows nothing
    assert "| step time, one process interleaved | `equal` | 4 | 1.00 [" in capsys.readouterr().out
