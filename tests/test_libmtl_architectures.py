"""Our expert architectures against LibMTL's own code (LibMTL 1.1.5, the dev extra), on the same model: its MMoE,
CGC and DSelect_k driven with our experts over vector features and our weights copied in
(``mtl.tools.bench.libmtl``). Two implementations of one model must give the same parameter count, the same outputs
and the same gradients; on a map LibMTL's gates read the flattened map, and the counts differ by exactly that."""

import pytest
import torch

from mtl.tools.bench import libmtl as lb

TASKS = ["a", "b", "c"]


def _pair(name, shape=(6,)):
    torch.manual_seed(0)
    ours = lb.Ours(name, TASKS, shape, lb.DESIGNS[name][0])
    theirs = lb.libmtl_model(name, TASKS, shape)
    return ours, theirs


def _count(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name", list(lb.DESIGNS))
def test_libmtl_gives_our_outputs_and_gradients_on_the_same_model(name):
    ours, theirs = _pair(name)
    lb.copy_weights(name, ours, theirs)
    theirs.eval()  # DSelect_k's training forward back-propagates its entropy regulariser (ours does not apply it)
    assert _count(ours) == _count(theirs)
    f = torch.randn(5, 6) * 3  # large enough that DSelect-k's smooth steps reach their flat ends for some items
    probe = {t: torch.randn(5, 6) for t in TASKS}
    out_ours, out_theirs = ours(f), theirs(f)
    for t in TASKS:
        torch.testing.assert_close(out_ours[t], out_theirs[t], rtol=1e-5, atol=1e-6)
    sum((out_ours[t] * probe[t]).sum() for t in TASKS).backward()
    sum((out_theirs[t] * probe[t]).sum() for t in TASKS).backward()
    for mine, its in lb.pairs(name, ours, theirs):
        for (n, p), q in zip(mine.named_parameters(), its.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")


def test_a_wrong_weight_is_seen():
    """The check can fail: one gate's weights left as LibMTL drew them changes that task's output."""
    ours, theirs = _pair("mmoe")
    lb.copy_weights("mmoe", ours, theirs)
    with torch.no_grad():
        theirs.gate_specific["b"][0].weight[1].add_(0.5)  # one expert's row: a shift of all rows cancels in the softmax
    f = torch.randn(5, 6)
    out_ours, out_theirs = ours(f), theirs(f)
    torch.testing.assert_close(out_ours["a"], out_theirs["a"])
    assert not torch.allclose(out_ours["b"], out_theirs["b"], atol=1e-4)


@pytest.mark.parametrize("name", list(lb.DESIGNS))
def test_on_a_map_libmtl_gates_read_the_flattened_map(name):
    """C x h x w inputs to each of LibMTL's gate layers where ours read the C-vector of the map's mean."""
    c, h, w = 4, 3, 2
    ours, theirs = _pair(name, (c, h, w))
    # the outputs of a task's gate layers: MMoE 4 experts; CGC 2 shared + 1 own; DSelect-k k = 2 selectors of
    # log2(4) = 2 logits each, and the k selector weights
    outs = {"mmoe": 4, "cgc": 3, "dselect_k": 2 * 2 + 2}[name]
    assert _count(theirs) - _count(ours) == len(TASKS) * outs * (c * h * w - c)


def test_libmtl_dselect_k_codes_are_all_ones_as_it_makes_them():
    """Why ``libmtl_model`` gives LibMTL's DSelect_k its intended codes: as made, every expert's code is all ones (so
    the comparison above would fail). If LibMTL or NumPy changes this, ``intended_codes`` is no longer needed."""
    torch.manual_seed(0)
    arch = lb.libmtl_architectures()
    raw = arch.DSelect_k(task_name=TASKS, encoder_class=lambda: torch.nn.Identity(), decoders=None, rep_grad=False,
                         multi_input=False, device="cpu", img_size=[6], num_experts=[4], num_nonzeros=2, kgamma=1.0)
    assert bool(raw._binary_codes.all())
    assert lb.intended_codes(raw)[0].tolist() == [[False, False], [False, True], [True, False], [True, True]]


def test_the_benchmark_prints_a_row_per_case_and_the_encoder_counts(capsys):
    assert lb.main(["--steps", "1", "--warmup", "0", "--architectures", "mmoe"]) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| ") and "mmoe" in r]
    assert len(rows) == len(lb.CASES)
    assert "| yes |" in rows[1] and "flattened map" in rows[0]
    counts = {r.split("|")[1].strip(): r for r in out.splitlines() if r.startswith(("| mtan", "| cross", "| ple"))}
    assert set(counts) == {"mtan", "cross_stitch", "ple"}


def test_without_libmtl_the_benchmark_says_so_and_exits_2(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "LibMTL.architecture", None)  # an import of it now raises ImportError
    assert lb.main(["--steps", "1", "--warmup", "0", "--architectures", "mmoe"]) == 2
    err = capsys.readouterr().err
    assert "needs LibMTL" in err and "Traceback" not in err
