"""Multi-input mode, in-process and quick: the config section and its refusals, the per-task data sets, the
per-task samplers (and their resume), and the step plan every rank derives alone (the same global rows at 1 and
2 processes). The DDP proofs are in tests/test_multi_input_ddp.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from mtl.config.schema import parse_overrides
from mtl.data.multi_input import MultiInputStream, SamplingPlan, TaskSampler, build_task_datasets, step_tasks
from mtl.errors import ConfigError, DataError
from mtl.setup.checks import load_run_config
from mtl.tasks import task_types

from .conftest import ROOT

MI = os.path.join(ROOT, "configs", "multi_input.yaml")


def errors_of(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_run_config(MI, overrides)
    return str(e.value)


def test_the_shipped_config_loads_and_fills_every_tasks_section():
    cfg = load_run_config(MI)
    assert set(cfg.data.per_task) == {"cls", "gen"}
    assert cfg.data.per_task.gen.on_error == "raise" and cfg.data.per_task.cls.ratio == 1.0  # defaults filled in


# each group is one config load: every error is reported at once
REFUSALS = [
    (["data.per_task.gne.source=synthetic", "data.per_task.gen.batch_sise=3", "data.sampling.policy=round_robn",
      "data.per_task.cls.source=imagefoldr", "data.per_task.gen.on_error=skip", "data.per_task.gen.source=manifest"],
     ["data.per_task.gne: 'gne' is not a task of this run — did you mean 'gen'?",
      "did you mean 'data.per_task.gen.batch_size'?", "did you mean 'round_robin'?", "did you mean 'imagefolder'?",
      "data.per_task.gen: source=manifest needs train_path and val_path"]),
    (["tasks=[cls,gen,count]", "data.sampling.policy=mixed", "data.batch_size=1"],
     ["add data.per_task.count", "sampling.policy=mixed puts every task in every step"]),
    (["data.sampling.policy=round_robin", "ddp.strategy=task_grads", "weighting.method=moco"],
     ["weighting.method: moco is not supported with data.sampling.policy=round_robin",
      "it tracks each task's gradient and lambda over every task with step-indexed rates"]),
    (["data.sampling.policy=temperature", "ddp.strategy=combined"],
     ["ddp.strategy: combined builds DDP"]),
    (["data.sampling.policy=weighted", "ddp.strategy=detach"],
     ["ddp.strategy: detach builds DDP with find_unused_parameters=false",
      "Use ddp.strategy=find_unused, accumulate, placeholder, feature_leaf or task_grads"]),
]

# with tasks absent from whole steps: the strategies that give the absent heads a zero gradient, and the methods
# that weigh or combine the present tasks only (tests/test_absent_tasks.py, tests/test_multi_input_ddp.py)
ALLOWED = [
    ["data.sampling.policy=round_robin", "ddp.strategy=feature_leaf"],
    ["data.sampling.policy=round_robin", "ddp.strategy=feature_leaf", "weighting.source=features",
     "weighting.method=mgda"],
    ["data.sampling.policy=weighted", "ddp.strategy=task_grads", "weighting.method=gradnorm"],
    ["data.sampling.policy=temperature", "ddp.strategy=find_unused", "weighting.method=famo"],
]


@pytest.mark.parametrize("overrides", ALLOWED)
def test_what_copes_with_absent_tasks_is_allowed(overrides):
    load_run_config(MI, overrides)


@pytest.mark.parametrize("overrides, says", REFUSALS)
def test_a_bad_multi_input_config_is_refused_naming_the_key_and_the_fix(overrides, says):
    text = errors_of(overrides)
    for line in says:
        assert line in text


def test_sampling_without_per_task_data_is_refused():
    from .conftest import TINY

    with pytest.raises(ConfigError, match="applies to multi-input mode only"):
        load_run_config(TINY, ["data.sampling.policy=mixed"])


def test_the_combinations_that_cope_with_absent_tasks_are_accepted():
    cfg = load_run_config(MI, ["data.sampling.policy=round_robin", "ddp.strategy=find_unused"])
    from mtl.setup.multi_input import check
    from mtl.strategies import strategy_types
    from mtl.weighting import weighting_types

    for policy, strategy, method, fu in [("round_robin", "find_unused", "equal", None),
                                         ("weighted", "accumulate", "uw", None),
                                         ("temperature", "placeholder", "gls", None),
                                         ("round_robin", "combined", "rlw", True),
                                         ("mixed", "task_grads", "pcgrad", None), ("mixed", "feature_leaf", "famo", None),
                                         ("round_robin", "find_unused", "dwa", None)]:
        cfg.data.sampling.policy, cfg.ddp.find_unused_parameters = policy, fu
        assert check(cfg, strategy_types()[strategy], weighting_types()[method]) == [], (policy, strategy, method)


def test_the_synthetic_per_task_sets_are_disjoint_labelled_only_and_captioned_only():
    cfg = load_run_config(MI, ["data.per_task.cls.train_size=8", "data.per_task.gen.train_size=8"])
    types = task_types()
    sets = build_task_datasets(cfg, {t: types[t] for t in cfg.tasks})
    cls, gen = sets["cls"][0], sets["gen"][0]
    assert set(cls[0]) == {"image", "index", "label"} and set(gen[0]) == {"image", "index", "captions"}
    assert not any(torch.equal(cls[i]["image"], gen[j]["image"]) for i in range(8) for j in range(8))
    assert not torch.equal(sets["cls"][1][0]["image"], cls[0]["image"])  # val is another stream too
    again = build_task_datasets(cfg, {t: types[t] for t in cfg.tasks})  # deterministic by seed
    assert torch.equal(again["gen"][0][3]["image"], gen[3]["image"])


def _manifest(tmp_path, name: str, labels: list) -> str:
    from PIL import Image

    (tmp_path / "img").mkdir(exist_ok=True)
    lines = []
    for i, label in enumerate(labels):
        Image.new("RGB", (24, 24), (30 * i, 90, 200 - 20 * i)).save(tmp_path / "img" / f"{name}{i}.png")
        lines.append(json.dumps({"image": f"img/{name}{i}.png", "caption": "a shape", **label}))
    (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / f"{name}.jsonl")


def _cls_manifest_sets(tmp_path, train_labels, val_labels):
    cfg = load_run_config(MI, ["data.per_task.cls.source=manifest", "data.image_size=32",
                               f"data.per_task.cls.train_path={_manifest(tmp_path, 'train', train_labels)}",
                               f"data.per_task.cls.val_path={_manifest(tmp_path, 'val', val_labels)}"])
    types = task_types()
    return build_task_datasets(cfg, {t: types[t] for t in cfg.tasks})


def test_a_labelled_tasks_manifest_is_read_with_strict_labels(tmp_path):
    """A classification task on a manifest: a missing label, or labels of both kinds (class names and indices) in
    one file, is an error naming the line (never class 0 in silence), and a val label outside the training classes
    is one too."""
    good = [{"label": 0}, {"label": 1}, {"label": 1}]
    sets = _cls_manifest_sets(tmp_path, good, [{"label": 1}])
    assert [sets["cls"][0][i]["label"] for i in range(3)] == [0, 1, 1]
    with pytest.raises(DataError, match=r"train.jsonl line 2: no 'label'"):
        _cls_manifest_sets(tmp_path, [{"label": 0}, {}, {"label": 1}], [{"label": 0}])
    with pytest.raises(DataError, match=r"line 2: label 0 is an integer, but the labels before it are class names"):
        _cls_manifest_sets(tmp_path, [{"label": "x"}, {"label": 0}], [{"label": 0}])
    with pytest.raises(DataError, match=r"val.jsonl line 1: label 2 is outside \[0, 2\)"):
        _cls_manifest_sets(tmp_path, good, [{"label": 2}])


def test_the_skipped_lines_of_every_tasks_data_are_counted(tmp_path):
    """on_error=skip on the caption task's own manifest: its bad line is in the run's report (``data_skipped``),
    not only the labelled task's set's."""
    from mtl.setup.build import build_run_inputs

    path = _manifest(tmp_path, "cap", [{}, {}, {}])
    with open(path, "a") as f:
        f.write(json.dumps({"image": "img/cap0.png"}) + "\n")  # no caption
    cfg = load_run_config(MI, ["data.per_task.gen.source=manifest", "data.per_task.gen.on_error=skip",
                               f"data.per_task.gen.train_path={path}", f"data.per_task.gen.val_path={path}",
                               "data.image_size=32", "data.per_task.cls.train_size=8", "data.per_task.cls.val_size=4"])
    count, reasons = build_run_inputs(cfg).skipped_lines()
    assert count == 2 and all("cap.jsonl line 4: no 'caption'" in r for r in reasons)  # train and val


def test_mixed_with_as_many_global_rows_as_tasks_puts_each_task_once():
    cfg = load_run_config(MI, ["data.sampling.policy=mixed", "data.batch_size=2"])  # 2 rows x 1 process, 2 tasks
    plan = SamplingPlan.from_config(cfg, {"cls": 10, "gen": 10})
    for step in range(3):
        assert sorted(step_tasks(plan, step, 1)) == ["cls", "gen"]


def test_a_task_sampler_runs_epochs_and_resumes_from_its_state():
    s = TaskSampler(10, seed=0, task="gen")
    first = [s.take(4) for _ in range(2)]
    assert {e for _, e in first} == {0} and len(set(first[0][0] + first[1][0])) == 8
    state = s.state_dict()
    later = [s.take(4) for _ in range(5)]
    assert later[0][1] == 1  # 2 left < 4: a new epoch, in a new order
    r = TaskSampler(10, seed=0, task="gen")
    r.load_state_dict(state)
    assert [r.take(4) for _ in range(5)] == later
    assert TaskSampler(10, seed=0, task="cls").take(4) != TaskSampler(10, seed=0, task="gen").take(4)


class _Items(torch.utils.data.Dataset):
    """Items that are only their index (no rendering): enough to check which rows a rank gets."""

    def __init__(self, n, field):
        self.n, self.field = n, field

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        i = key[0]
        return {"image": torch.full((1, 1, 1), float(i)), "index": i, self.field: i}


def _collate(records):
    out = {k: torch.tensor([r[k] for r in records]) for k in records[0] if k != "image"}
    return {**out, "image": torch.stack([r["image"] for r in records])}


def _rows(batch):
    return {t: sorted(batch["index"][slice(*sub["rows"])].tolist()) for t, sub in batch["multi_input"].items()}


POLICIES = ["all", "round_robin", "weighted", "temperature", "mixed"]


def sizes_then_policy(tmp_path, sizes: list[str], policy: str):
    """MI with ``sizes`` in a file and the policy on the command line: the sizes the policy does not read are left out,
    set before it chose (on one command line they would be refused: its keys are judged together)."""
    path = tmp_path / "sizes.yaml"
    path.write_text(yaml.safe_dump({"base": MI, **parse_overrides(sizes)[0]}))
    return load_run_config(str(path), [f"data.sampling.policy={policy}"])


def test_two_ranks_together_hold_exactly_the_single_process_rows_every_step(tmp_path):
    base = sizes_then_policy(tmp_path, ["ddp.strategy=find_unused", "data.per_task.gen.ratio=0.3",
                                        "data.per_task.cls.batch_size=3", "data.per_task.gen.batch_size=2",
                                        "data.batch_size=4"], "all")
    for policy in POLICIES:
        _check_policy(base, policy)


def _check_policy(base, policy):
    cfg = base.copy()
    cfg.data.sampling.policy = policy
    one = cfg.copy()
    one.data.batch_size, one.data.per_task.cls.batch_size, one.data.per_task.gen.batch_size = 8, 6, 4
    sets = {"cls": _Items(20, "label"), "gen": _Items(13, "captions")}
    collates = {"cls": _collate, "gen": _collate}
    single = MultiInputStream(one, sets, collates, 0, 1)
    ranks = [MultiInputStream(cfg, sets, collates, r, 2) for r in range(2)]
    uneven = False
    for step in range(12):
        s, b0, b1 = single.next_batch(step), ranks[0].next_batch(step), ranks[1].next_batch(step)
        assert s["multi_input"].keys() == b0["multi_input"].keys() == b1["multi_input"].keys()  # agreed, no comm
        for t, rows in _rows(s).items():
            assert sorted(_rows(b0)[t] + _rows(b1)[t]) == rows
            n = [b["multi_input"][t]["rows"][1] - b["multi_input"][t]["rows"][0] for b in (b0, b1)]
            assert all(b["multi_input"][t]["global_rows"] == len(rows) for b in (s, b0, b1))
            uneven |= n[0] != n[1] and 0 in n
        assert b0["image"].shape[0] == sum(len(v) for v in _rows(b0).values())
    assert single.state_dict() == ranks[0].state_dict() == ranks[1].state_dict()
    if policy == "mixed":
        assert uneven  # a task absent on one rank only, in some step
    if policy == "round_robin":
        assert [list(dict.fromkeys(step_tasks(single.plan, k, 2))) for k in range(3)] == [["cls"], ["gen"], ["cls"]]


def test_an_absent_task_gets_a_zero_loss_through_its_head_and_the_features():
    from mtl.models.multitask import MultiTaskModel

    backbone = torch.nn.Conv2d(1, 2, 1)
    heads = {"a": torch.nn.Linear(2, 1), "b": torch.nn.Linear(2, 1)}

    class Head(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, f, batch):
            return self.lin(f.mean((2, 3))).mean()

    model = MultiTaskModel(backbone, {k: Head(v) for k, v in heads.items()})
    batch = {"image": torch.randn(3, 1, 2, 2), "multi_input": {
        "a": {"rows": (0, 3), "global_rows": 4, "world": 2}, "b": {"rows": (3, 3), "global_rows": 2, "world": 2}}}
    out = model(batch, feature_leaf=True)
    assert float(out["losses"]["b"].detach()) == 0.0
    out["losses"]["b"].backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.heads["b"].parameters())
    assert out["leaf"].grad is not None and not out["leaf"].grad.any()
    plain = model.heads["a"](model.backbone(batch["image"]), {})  # local mean over its 3 rows
    assert torch.allclose(out["losses"]["a"], plain * 3 * 2 / 4)  # a share of the mean over the 4 global rows


def test_dwa_moves_each_tasks_history_on_only_in_the_steps_that_hold_it():
    from mtl.weighting.dwa import dwa_weights

    from .conftest import TINY

    cfg = load_run_config(TINY, ["weighting.method=dwa"])
    from mtl.setup.build import build_weighting

    w = build_weighting(cfg)
    for losses in ({"cls": 1.0}, {"gen": 2.0}, {"cls": 0.5}):
        w.end_step(losses)
        assert w.weights() == {"cls": 1.0, "gen": 1.0}  # gen has one observation
    state = w.state_dict()
    w.end_step({"cls": 0.25})  # gen absent again: its (single) observation stays
    assert w.last[1] == 2.0 and w.prev[1] is None
    w.end_step({"gen": 1.0})  # now every task has two: cls 0.5 -> 0.25, gen 2.0 -> 1.0
    assert list(w.weights().values()) == dwa_weights([0.25, 1.0], [0.5, 2.0], cfg.weighting.options.T)
    again = build_weighting(cfg)
    again.load_state_dict(state)  # resumes mid-way with the same per-task histories
    again.end_step({"cls": 0.25})
    again.end_step({"gen": 1.0})
    assert again.weights() == w.weights()


def test_a_users_method_is_judged_and_listed_like_a_shipped_one(tmp_path):
    """weighting_modules: a user's stateless loss-level method is allowed with a policy that leaves tasks out, and a
    refused method's message lists it among the methods that would do."""
    path = tmp_path / "halves.py"
    path.write_text("from mtl.weighting.base import Weighting\n\n\nclass Halves(Weighting):\n    name = 'halves'\n\n"
                    "    def weights(self):\n        return {t: 0.5 for t in self.tasks}\n")
    over = ["data.sampling.policy=round_robin", "ddp.strategy=task_grads", f"weighting_modules=[{path}]"]
    load_run_config(MI, [*over, "weighting.method=halves"])
    text = errors_of([*over, "weighting.method=moco"])
    assert "weighting.method: moco is not supported" in text and "halves" in text.split("present tasks only (")[1]


@pytest.mark.parametrize("policy", ["round_robin", "weighted", "temperature", "all"])
def test_a_task_set_smaller_than_its_global_batch_is_refused_by_the_config_check(monkeypatch, policy):
    """per_task.gen.batch_size 4 per process, train_size 6: one process fits, two (8 global rows) do not; the check
    runs before the process group starts, with torchrun's WORLD_SIZE."""
    overrides = ["data.per_task.gen.train_size=6", f"data.sampling.policy={policy}", "ddp.strategy=find_unused"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    load_run_config(MI, overrides)
    monkeypatch.setenv("WORLD_SIZE", "2")
    msg = errors_of(overrides)
    assert "data.per_task.gen.batch_size: 4 per process x 2 process(es) = 8 rows" in msg and "train_size (6)" in msg
    assert "data.per_task.gen.batch_size <= 3" in msg


@pytest.mark.parametrize("policy", POLICIES)
def test_a_task_set_of_any_source_smaller_than_its_global_rows_is_refused_before_the_first_step(policy, tmp_path):
    """The stream checks the loaded sets' sizes (a manifest's or an ImageFolder's is known only once read): gen has
    6 items; 4 rows per process fit one process, not two, under every policy (mixed: up to 4 x 2 - 1 rows, the
    other task holding at least one)."""
    cfg = sizes_then_policy(tmp_path, ["ddp.strategy=find_unused", "data.per_task.cls.batch_size=2",
                                       "data.per_task.gen.batch_size=4", "data.batch_size=4"], policy)
    sets, collates = {"cls": _Items(20, "label"), "gen": _Items(6, "captions")}, {"cls": _collate, "gen": _collate}
    MultiInputStream(cfg, sets, collates, 0, 1).next_batch(0)
    with pytest.raises(DataError) as e:
        MultiInputStream(cfg, sets, collates, 0, 2)
    mixed = policy == "mixed"
    key = "data.batch_size" if mixed else "data.per_task.gen.batch_size"
    need = "7 of its training items (data.batch_size x 2 process(es) less the 1 row(s) of the other tasks)" if mixed \
        else f"8 of its training items ({key} x 2 process(es))"
    assert f"task 'gen': a step can ask for {need}" in e.value.message
    assert "has 6" in e.value.message and f"lower {key} to at most 3" in e.value.message


def test_feature_gradient_cosines_are_not_logged_when_the_tasks_see_different_rows(tmp_path, capsys):
    """In multi-input mode each task's gradient lives on its own rows of the features, so their cosine is 0 by
    construction: the norms are logged, the cosines are not."""
    import train

    out = tmp_path / "run"
    assert train.main(["--config", MI, f"output_dir={out}", "ddp.strategy=feature_leaf", "trainer.max_steps=2",
                       "trainer.log_every=1", "trainer.eval_every=100", "checkpoint.every_steps=0",
                       "trainer.progress=false"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert train_lines and all("feat_grad_norm/cls" in x for x in train_lines)
    assert not any(k.startswith("feat_grad_cos/") for x in train_lines for k in x)
