"""A key the user set that the run does not read is an error (exit 2), never silently ignored (mtl/config/read_rules.py).

Every key of the schema (``config_keys``, and a multi-input task's section, ``TaskDataConfig``) is driven through
"set but not read" in each set-up where it does not apply, and must be accepted in each where it does. The
expectations below are written out here, independently of ``READS``: a new schema key fails
``test_every_schema_key_is_classified`` until it is classified here (read everywhere, or where not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

import train
from mtl.config.schema import (
    TaskDataConfig,
    config_keys,
    config_summary,
    load_config_collecting,
    parse_overrides,
    to_yaml,
)
from mtl.errors import ConfigError
from mtl.setup.checks import load_run_config
from mtl.setup.reads import run_shape, unread_errors
from mtl.setup.resume import verify_resume_config

from .conftest import ROOT, TINY, example_outside

backbone_file = example_outside("small_cnn.py", "my_backbone.py")

MULTI_SYN = "data.per_task={cls: {source: synthetic}, gen: {source: synthetic}}"
# the set-ups: overrides on configs/tiny.yaml ("{backbone}": the plug-in backbone's file, outside the package)
SETUPS = {
    "synthetic": [],
    "manifest": ["data.source=manifest", "data.train_path=t.jsonl", "data.val_path=v.jsonl"],
    "imagefolder": ["data.source=imagefolder", "data.train_path=tr", "data.val_path=va"],
    "qm9": ["data.source=qm9", "model.backbone.name=mpnn"],
    "hf": ["data.source=hf", "data.hf.path=h"],
    "webdataset": ["data.source=webdataset", "data.webdataset.train_shards=t-{0..1}.tar", "data.webdataset.val_shards=v.tar"],
    "hf_stream": ["data.source=hf_stream", "data.hf_stream.train_files=t-*.parquet", "data.hf_stream.val_files=v.parquet"],
    "multi": [MULTI_SYN],  # every task its own synthetic set, sampling.policy=all
    "multi_files": ["data.per_task={cls: {source: imagefolder, train_path: a, val_path: b}, gen: {source: manifest, "
                    "train_path: c.jsonl, val_path: d.jsonl}}", "data.sampling.policy=weighted"],
    "multi_mixed": [MULTI_SYN, "data.sampling.policy=mixed"],
    "multi_temperature": [MULTI_SYN, "data.sampling.policy=temperature"],
    "plugin_backbone": ["backbone_modules=[{backbone}]", "model.backbone.name=small_cnn"],
    "cls_only": ["tasks=[cls]"],
    "plateau": ["optim.scheduler=plateau", "optim.warmup_steps=0"],
    "sgd": ["optim.name=sgd"],
    "static": ["weighting.method=static"],
    "detach": ["ddp.strategy=detach"],
    "bilevel": ["weighting.method=autolambda"],
    "fsdp2": ["parallel.engine=fsdp2"],
}
MULTI = {"multi", "multi_files", "multi_mixed", "multi_temperature"}
STREAMS = {"webdataset", "hf_stream"}  # streamed sources (mtl/data/streamed.py, mtl/data/parquet_stream.py)
ONE_SYNTHETIC = set(SETUPS) - MULTI - {"manifest", "imagefolder", "qm9", "hf"} - STREAMS  # one synthetic data set
EVERY = set(SETUPS)

# key -> the set-ups whose run does not read it (train.py). A key not here is read by every run: ALWAYS.
NOT_READ = {
    "data.source": MULTI,
    "data.val_path": ONE_SYNTHETIC | STREAMS | {"qm9", "hf"} | MULTI,
    "data.on_error": ONE_SYNTHETIC | {"qm9"} | MULTI,
    "data.train_path": ONE_SYNTHETIC | STREAMS | {"qm9", "hf"} | MULTI,
    "data.test_path": ONE_SYNTHETIC | STREAMS | {"qm9", "hf"} | MULTI,
    "data.num_classes": ONE_SYNTHETIC | STREAMS | {"qm9"} | MULTI,
    "data.image_root": ONE_SYNTHETIC | STREAMS | {"imagefolder", "qm9", "hf"} | MULTI,
    **{f"data.hf.{k}": EVERY - {"hf"} for k in ("path", "builder", "data_files", "train_split", "val_split",
                                                  "test_split", "image_column", "label_column", "caption_column",
                                                  "verify", "cache_dir")},
    **{f"data.webdataset.{k}": EVERY - {"webdataset"}
       for k in ("train_shards", "val_shards", "class_names", "shuffle_buffer", "verify_images")},
    **{f"data.hf_stream.{k}": EVERY - {"hf_stream"} for k in ("train_files", "val_files", "image_column",
                                                             "label_column", "caption_column", "shuffle_buffer",
                                                             "verify_images")},
    **{f"data.synthetic.{k}": {"manifest", "imagefolder", "qm9", "hf"} | STREAMS | MULTI
       for k in ("train_size", "val_size", "train_seed_offset", "val_seed_offset", "test_size", "test_seed_offset")},
    **{f"data.synthetic.{k}": {"manifest", "imagefolder", "qm9", "hf", "multi_files"} | STREAMS
       for k in ("num_classes", "max_count", "noise", "clutter")},
    **{f"data.qm9.{k}": EVERY - {"qm9"}
       for k in ("root", "cache_dir", "molecules", "test_size", "val_size", "train_size", "split_seed", "graph")},
    "data.image_size": {"qm9"},
    "data.normalize": {"qm9"},
    **{f"data.augment.{k}": ONE_SYNTHETIC | {"qm9", "multi", "multi_mixed", "multi_temperature"}
       for k in ("random_resized_crop", "scale", "ratio", "hflip")},
    "data.batch_size": {"multi", "multi_files", "multi_temperature"},
    "data.sampling.policy": EVERY - MULTI,
    "data.sampling.weights": EVERY - {"multi_files", "multi_mixed"},  # mixed draws each row's task by the weights
    "data.sampling.temperature": EVERY - {"multi_temperature"},
    "data.heldout": EVERY - {"bilevel"},
    "tokenizer.path": {"cls_only"},
    "tokenizer.vocab_size": {"cls_only"},
    **{f"model.decoder.{k}": {"cls_only"}
       for k in ("pretrained", "n_layer", "n_embd", "n_head", "dropout", "max_positions")},
    **{f"model.backbone.{k}": {"qm9", "plugin_backbone"} for k in ("weights", "norm", "stages", "freeze_blocks")},
    **{f"model.backbone.{k}": EVERY for k in ("pretrained", "config")},  # hf_vision, timm
    "weighting.weights": EVERY - {"static"},
    # the drive sets its default, unweighted, which asks for nothing (off); weighted is refused with a method that does
    # not read it and accepted with a Gram method: tests/test_weighted_heads.py
    "weighting.heads": set(),
    "ddp.detach_owner": EVERY - {"detach"},
    **{f"optim.plateau.{k}": EVERY - {"plateau"} for k in ("factor", "patience", "min_lr", "baselines")},
    "optim.betas": {"sgd"},
    "ddp.bucket_cap_mb": {"fsdp2"},  # DDP's gradient buckets: FSDP2 has no reducer
    "trainer.num_samples": {"cls_only"},  # sample captions: the caption task declares it
    "init_from_fresh_class_head": set(),  # the drive sets init_from too (a filler): see test_a_fresh_head_needs_init_from
    # the drive sets the watched metric too (a filler): tests/test_best_and_early_stop.py refuses them without it
    "checkpoint.best_mode": set(), "trainer.early_stopping.patience": set(), "trainer.early_stopping.min_delta": set(),
    "trainer.early_stopping.mode": set(),
    "logging.mlflow_dir": EVERY,  # no set-up lists mlflow in logging.trackers: see test_mlflow_dir_is_read_with_mlflow
    # the drive sets model.peft.method too (a filler): tests/test_peft.py refuses them without it
    **{f"model.peft.{k}": set() for k in ("r", "alpha", "dropout", "target_modules", "per_task", "shared")},
    # sections named by task: the section of a task the run does not train (test_sections_of_other_tasks)
    "task_options": set(), "task_instances": set(), "loss_scale": set(),
}
# read by every run (sections of plug-in options are checked against the plug-in's Options; bench: the tool's own)
ALWAYS = {"output_dir", "seed", "precision", "device", "resume", "resume_reshard", "init_from", "overwrite", "tasks",
          "task_modules", "weighting_modules", "backbone_modules", "architecture_modules", "data.eval_batch_size", "data.num_workers",
          "data.per_task", "model.backbone.name", "model.backbone.options", "model.architecture.name",
          "model.architecture.options", "parallel.engine", "ddp.strategy",
          "ddp.backend", "ddp.find_unused_parameters", "ddp.static_graph", "ddp.timeout_s",
          "ddp.unsafe", "ddp.replica_check_every", "ddp.nan_monitor", "weighting.method", "weighting.options",
          "weighting.source", "optim.name", "optim.lr", "optim.weight_decay", "optim.scheduler", "optim.warmup_steps",
          "optim.grad_clip", "optim.layer_decay", "model.activation_checkpointing", "model.compile", "model.backbone.freeze",
          "trainer.max_steps", "trainer.log_every", "trainer.eval_every",
          "trainer.eval_max_batches", "trainer.max_bad_steps", "trainer.poison",
          "trainer.progress", "checkpoint.every_steps", "checkpoint.keep_last", "bench", "checkpoint.best_metric",
          "model.peft.method", "checkpoint.trainable_only",
          "trainer.early_stopping.metric", "logging.trackers", "logging.group"}
# data.per_task.<task>.<key> -> the multi-input set-ups (and task) whose run does not read it
PER_TASK_NOT_READ = {
    "source": set(),
    "batch_size": {("multi_mixed", t) for t in ("cls", "gen")},
    "ratio": {(s, t) for s in MULTI - {"multi_files", "multi_mixed"} for t in ("cls", "gen")},
    "train_size": {("multi_files", "cls"), ("multi_files", "gen")},
    "val_size": {("multi_files", "cls"), ("multi_files", "gen")},
    "train_path": {(s, t) for s in MULTI - {"multi_files"} for t in ("cls", "gen")},
    "val_path": {(s, t) for s in MULTI - {"multi_files"} for t in ("cls", "gen")},
    "on_error": {(s, t) for s in MULTI - {"multi_files"} for t in ("cls", "gen")},
    "image_root": {(s, t) for s in MULTI - {"multi_files"} for t in ("cls", "gen")} | {("multi_files", "cls")},
    "hf": {(s, t) for s in MULTI for t in ("cls", "gen")},  # read where a task's source is hf
}
# what an evaluation (python -m mtl.tools.evaluate) does not read of what training reads
TRAINING_ONLY = {"data.train_path", "data.test_path", "data.num_classes", "data.synthetic.train_size",
                 "data.synthetic.train_seed_offset", "data.synthetic.test_size", "data.synthetic.test_seed_offset",
                 "data.qm9.train_size", "data.augment.random_resized_crop", "data.augment.scale", "data.augment.ratio",
                 "data.augment.hflip", "data.batch_size", "data.sampling.policy", "data.sampling.weights",
                 "data.sampling.temperature", "data.heldout", "logging.trackers", "logging.group",
                 "logging.mlflow_dir"}
SECTIONS = {"task_options", "task_instances", "loss_scale", "data.per_task", "model.backbone.options",
            "model.architecture.options",
            "weighting.options", "bench"}  # mappings: driven by name, not by value (below)
FILLER = {"str": "x", "int": 1, "float": 0.5, "bool": True, "Any": "x", "dict": {"path": "x"}}


def schema_keys() -> list[str]:
    return [k for k, *_ in config_keys()]


def test_every_schema_key_is_classified():
    keys = set(schema_keys())
    assert not keys - set(NOT_READ) - ALWAYS, f"classify these keys in NOT_READ or ALWAYS: {keys - set(NOT_READ) - ALWAYS}"
    assert not set(NOT_READ) & ALWAYS
    assert set(PER_TASK_NOT_READ) == {k for k, *_ in config_keys(TaskDataConfig)}


def setup(name: str, backbone: str) -> list[str]:
    return [o.replace("{backbone}", backbone) for o in SETUPS[name]]


def value_of(cfg, key: str, type_name: str):
    """A value to set ``key`` to that does not change the set-up: its value in ``cfg``, or a filler for null."""
    value = OmegaConf.select(cfg, key)
    if value is None:
        value = FILLER[type_name.split(" |")[0].split("[")[0]]
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def unread_named(folder, overrides: list[str], tool: str = "train") -> tuple[set[str], list[str]]:
    """The keys named by "set but not read" errors for a config file on configs/tiny.yaml that sets ``overrides``
    all in one place (so that none is set after another: each key the run does not read is an error), and those
    errors. The mechanism alone, without the other checks, so that no other message about a key stands in for it."""
    path = folder / "setup.yaml"
    data, problems = parse_overrides(overrides)
    assert not problems, problems
    path.write_text(yaml.safe_dump({"base": TINY, **data}))
    errors, setters = [], {}
    cfg = load_config_collecting(str(path), [], errors, setters)
    assert not errors, errors
    found, _ = unread_errors(cfg, run_shape(cfg, tool), setters)
    return {k for e in found for k in e.split(": ")[0].split(", ")}, found


def drive(folder, name: str, backbone: str, tool: str = "train") -> tuple[set[str], set[str], list[str]]:
    """Set every schema key (but the sections) with the set-up; (keys refused, keys set, the errors)."""
    over = setup(name, backbone)
    cfg = load_config_collecting(TINY, over, [])
    keys = [(k, t) for k, t, *_ in config_keys() if k not in SECTIONS]
    sets = [f"{k}={json.dumps(value_of(cfg, k, t))}" for k, t in keys]
    refused, errors = unread_named(folder, [*over, *sets], tool)
    return refused, {k for k, _ in keys}, errors


@pytest.mark.parametrize("name", list(SETUPS))
def test_every_key_set_where_it_is_not_read_is_refused_and_accepted_where_it_is(name, backbone_file, tmp_path):
    refused, driven, errors = drive(tmp_path, name, backbone_file)
    expected = {k for k in driven if name in NOT_READ.get(k, set())}
    assert refused == expected, (f"refused but read: {refused - expected}; read but not refused: "
                                 f"{expected - refused}", errors)


@pytest.mark.parametrize("name", ["synthetic", "manifest", "multi_files"])
def test_an_evaluation_does_not_read_what_only_training_reads(name, backbone_file, tmp_path):
    refused, driven, errors = drive(tmp_path, name, backbone_file, tool="evaluate")
    data = {k for k in driven if k.startswith("data.") or k == "seed"}
    expected = {k for k in data if name in NOT_READ.get(k, set()) or k in TRAINING_ONLY}
    assert refused & data == expected, (refused & data ^ expected, errors)


@pytest.mark.parametrize("name", sorted(MULTI))
def test_every_key_of_a_task_s_data_section_is_driven_too(name, tmp_path):
    over = setup(name, "")
    section = json.loads(json.dumps(OmegaConf.to_container(load_config_collecting(TINY, over, []).data.per_task)))
    sets = [f"data.per_task.{t}.{k}={json.dumps(section[t].get(k, FILLER[typ.split(' |')[0].split('[')[0]]))}"
            for t in ("cls", "gen") for k, typ, *_ in config_keys(TaskDataConfig)]
    refused, errors = unread_named(tmp_path, [*over, *sets])
    # a section's key (data.per_task.<task>.hf) is refused by the keys it holds (hf.path)
    refused = {".".join(k.split(".")[:4]) for k in refused if k.startswith("data.per_task.")}
    expected = {f"data.per_task.{t}.{k}" for k, where in PER_TASK_NOT_READ.items() for s, t in where if s == name}
    assert refused == expected, (refused ^ expected, errors)


def test_sections_of_other_tasks(tmp_path):
    """task_options, task_instances and loss_scale of a task the run does not train."""
    over = ["tasks=[cls]", "task_options.gen.max_tokens=5", "loss_scale.gen=2",
            "task_instances.U0={type: regression, field: U0_atom}"]
    refused, _ = unread_named(tmp_path, over)
    assert refused == {"task_options.gen.max_tokens", "loss_scale.gen", "task_instances.U0.type",
                       "task_instances.U0.field"}
    refused, _ = unread_named(tmp_path, ["tasks=[cls, gen, U0]", *over[1:]])
    assert not refused


# ------------------------------------------------------------------ the rule end to end


def test_the_reported_run_is_refused_with_one_message_naming_the_keys_the_cause_and_the_fix(tmp_path, capsys):
    """issue 32: ``train.py --config configs/tiny.yaml data.train_path=DIR data.val_path=DIR`` trained on the
    synthetic data, exit 0."""
    code = train.main(["--config", TINY, f"data.train_path={tmp_path}", f"data.val_path={tmp_path}",
                       f"output_dir={tmp_path / 'run'}", "trainer.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if "not read" in line]
    assert len(lines) == 1 and "data.train_path, data.val_path" in lines[0], err
    assert "data.source is synthetic" in lines[0] and "Set data.source=manifest or imagefolder" in lines[0], err
    assert not os.path.exists(tmp_path / "run")  # before anything starts


def test_every_error_is_collected_with_the_others():
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, ["optim.lr=-1", "data.val_path=x", "precision=fp99"])
    assert len(e.value.errors) == 3 and any(m.startswith("data.val_path: set (command line) but not read")
                                            for m in e.value.errors)


def test_a_key_set_before_the_choice_that_makes_it_unread_is_left_out_and_listed(tmp_path):
    """configs/tiny.yaml sets data.synthetic.* and the decoder; the command line chooses an image folder and one task:
    accepted (the later setting chose), left out of the saved config, and listed as left out by the summary."""
    cfg = load_run_config(TINY, ["data.source=imagefolder", f"data.train_path={tmp_path}", f"data.val_path={tmp_path}",
                                 "tasks=[cls]", f"output_dir={tmp_path / 'run'}"])
    saved = yaml.safe_load(to_yaml(cfg))
    assert "synthetic" not in saved["data"] and "decoder" not in saved["model"] and "tokenizer" not in saved
    assert saved["data"]["train_path"] == str(tmp_path) and saved["model"]["backbone"]["stages"] == 2
    *shown, left = config_summary(cfg).splitlines()
    assert not any("synthetic" in line or "decoder" in line for line in shown) and "stages=2" in "".join(shown)
    assert left.startswith("  not read by this run, left out: ") and "data.synthetic.train_size=256" in left
    assert "model.decoder.n_layer=1" in left and "task_options.gen" not in left  # dropped by the check: not in cfg
    # the same keys set after the choice (in the same place, the command line) are refused
    with pytest.raises(ConfigError, match=r"data.synthetic.train_size: set \(command line\) but not read"):
        load_run_config(TINY, ["data.source=imagefolder", "data.train_path=a", "data.val_path=b",
                               "data.synthetic.train_size=8"])


def test_a_plug_in_backbone_s_unread_keys_are_left_out_of_the_printed_config(backbone_file):
    cfg = load_run_config(TINY, [f"backbone_modules=[{backbone_file}]", "model.backbone.name=small_cnn"])
    *shown, left = config_summary(cfg).splitlines()  # tiny.yaml sets stages: 2
    assert "stages" not in "".join(shown) and "model.backbone.stages=2" in left and "stages" not in to_yaml(cfg)
    with pytest.raises(ConfigError, match="model.backbone.stages: set .* model.backbone.name=small_cnn does not read"):
        load_run_config(TINY, [f"backbone_modules=[{backbone_file}]", "model.backbone.name=small_cnn",
                               "model.backbone.stages=3"])


def test_a_resume_compares_only_the_keys_the_run_reads(tmp_path):
    """A checkpoint's config.yaml holds only the keys its run read; one written before (every key) resumes too."""
    over = ["tasks=[cls]", f"output_dir={tmp_path}"]
    cfg = load_run_config(TINY, over)
    for name, text in (("new", to_yaml(cfg)), ("old", OmegaConf.to_yaml(cfg, resolve=True))):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.yaml").write_text(text)
        verify_resume_config(str(folder), cfg)
    assert "decoder" not in (tmp_path / "new" / "config.yaml").read_text()
    assert "decoder" in (tmp_path / "old" / "config.yaml").read_text()


# ------------------------------------------------------------------ values: did you mean, the seed's range


@pytest.mark.parametrize("override, hint", [
    ("data.source=imagefolders", "did you mean 'imagefolder'?"), ("precision=bf61", "did you mean 'bf16'?"),
    ("device=cdua", "did you mean 'cuda'?"), ("data.on_error=skp", "did you mean 'skip'?"),
    ("data.normalize=imagenett", "did you mean 'imagenet'?"), ("ddp.backend=glo", "did you mean 'gloo'?"),
    ("parallel.engine=fsdp", "did you mean 'fsdp2'?"), ("optim.name=adam", "did you mean 'adamw'?"),
    ("optim.scheduler=cosin", "did you mean 'cosine'?"), ("ddp.strategy=feature_lef", "did you mean 'feature_leaf'?"),
    ("weighting.source=feature", "did you mean 'features'?"), ("model.backbone.norm=grup", "did you mean 'group'?"),
    ("data.sampling.policy=round-robin", "did you mean 'round_robin'?"),
    ("weighting.method=pcgard", "did you mean 'pcgrad'?"),
])
def test_a_mistyped_value_of_an_enum_key_gets_a_did_you_mean(override, hint):
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, [override, *(["data.per_task={cls: {}, gen: {}}"] if "sampling" in override else [])])
    key = override.split("=")[0]
    assert any(m.startswith(key) and hint in m for m in e.value.errors), e.value.errors


def test_data_source_qm9_typo_on_the_qm9_graph_key():
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, ["data.source=qm9", "model.backbone.name=mpnn", "data.qm9.graph=bonds"])
    assert any("data.qm9.graph" in m and "did you mean 'bond'?" in m for m in e.value.errors), e.value.errors


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_is_a_config_error(seed):
    """issue 36: seed=-1 or 4294967296 was a ValueError traceback from np.random.seed, exit 1."""
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, [f"seed={seed}"])
    assert e.value.errors == [f"seed: {seed} is outside 0..4294967295 (2**32 - 1), the seeds numpy takes; choose a "
                              "seed in that range"]


def test_the_largest_seed_trains(tmp_path):
    from mtl.setup.build import seed_everything

    cfg = load_run_config(TINY, [f"seed={2**32 - 1}"])
    seed_everything(cfg.seed)  # what raised before the check


@pytest.mark.slow
def test_the_toy_s_methods_get_a_did_you_mean():
    run = subprocess.run([sys.executable, "-m", "mtl.tools.bench.toy", "--methods", "cagard", "--steps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "did you mean 'cagrad'?" in run.stderr, run.stderr


# ------------------------------------------------------------------ the tools' overrides


def stand_in(config: str, *overrides: str):
    """What ``eval_config`` reads of a loaded model: its config, the folder's config.yaml as saved, the image size."""
    from types import SimpleNamespace

    cfg = load_run_config(config, list(overrides))
    return SimpleNamespace(cfg=cfg, saved_config=yaml.safe_load(to_yaml(cfg)), image_size=int(cfg.data.image_size),
                           files=SimpleNamespace(folder="model", config="model/config.yaml"))


def test_an_evaluation_refuses_an_override_it_does_not_read():
    """issue 32: ``evaluate --checkpoint RUN data.val_path=DIR`` on a synthetic-trained model scored the synthetic
    set; on a multi-input model ``data.source=imagefolder data.val_path=...`` was ignored."""
    from mtl.inference import eval_config

    model = stand_in(TINY)
    with pytest.raises(ConfigError) as e:
        eval_config(model, None, ["data.val_path=v.jsonl"])
    assert e.value.errors == ["data.val_path: set (command line) but not read: data.source is synthetic. Set "
                              "data.source=manifest or imagefolder, or remove data.val_path"]
    assert eval_config(model, None, ["data.source=manifest", "data.val_path=v.jsonl"]).data.val_path == "v.jsonl"
    with pytest.raises(ConfigError, match="data.train_path: .* python -m mtl.tools.evaluate does not read it"):
        eval_config(model, None, ["data.source=manifest", "data.val_path=v.jsonl", "data.train_path=t.jsonl"])
    multi = stand_in(os.path.join(ROOT, "configs", "multi_input.yaml"))
    with pytest.raises(ConfigError) as e:
        eval_config(multi, None, ["data.source=imagefolder", "data.val_path=folder"])
    assert len(e.value.errors) == 1 and e.value.errors[0].startswith("data.source, data.val_path: set (command line) "
                                                                      "but not read: multi-input mode"), e.value.errors
    eval_config(multi, None, ["data.per_task.cls.val_size=8"])  # what it reads


@pytest.mark.slow
def test_the_evaluate_tool_exits_2_on_an_override_it_does_not_read(tmp_path, capsys):
    from mtl.tools import evaluate

    out = tmp_path / "run"
    assert train.main(["--config", TINY, f"output_dir={out}", "trainer.max_steps=1", "checkpoint.every_steps=0"]) == 0
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(out), f"data.val_path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "data.val_path: set (command line) but not read: data.source is synthetic" in err and "Traceback" not in err


def test_a_fresh_head_needs_init_from(tmp_path):
    """init_from_fresh_class_head is read by a warm start only: set without init_from it is refused, naming init_from."""
    with pytest.raises(ConfigError, match="init_from_fresh_class_head: set .command line. but not read: init_from is not set"):
        load_run_config(TINY, ["init_from_fresh_class_head=true"])
    cfg = load_run_config(TINY, [f"init_from={tmp_path}", "init_from_fresh_class_head=true"])
    assert cfg.init_from_fresh_class_head is True


# ------------------------------------------------------------------ keys that did nothing; one command line, one judgement


@pytest.mark.parametrize("overrides, says", [
    (["parallel.engine=fsdp2", "ddp.bucket_cap_mb=1"],
     "ddp.bucket_cap_mb: set (command line) but not read: parallel.engine is fsdp2"),
    (["tasks=[cls]", "trainer.num_samples=7"],
     "trainer.num_samples: set (command line) but not read: no task of this run (cls) reads it"),
])
def test_a_key_that_did_nothing_is_refused_naming_it(overrides, says):
    """issue 41: both were accepted (DDP's other options are refused under FSDP2; only the caption task shows samples)."""
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, overrides)
    assert e.value.exit_code == 2 and any(m.startswith(says) for m in e.value.errors), e.value.errors


def test_no_samples_asked_of_a_run_without_captions_is_not_an_error():
    """trainer.num_samples=0 asks for nothing: accepted where no task reads it (and left out of the saved config)."""
    cfg = load_run_config(TINY, ["tasks=[cls]", "trainer.num_samples=0"])
    assert "num_samples" not in to_yaml(cfg)


@pytest.mark.parametrize("order", [["optim.betas=[0.5,0.5]", "optim.name=sgd"],
                                   ["optim.name=sgd", "optim.betas=[0.5,0.5]"]])
def test_keys_on_one_command_line_are_judged_together_in_either_order(order):
    """issue 41: the order of two overrides decided whether betas was refused or silently dropped."""
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, order)
    assert e.value.exit_code == 2 and any(m.startswith("optim.betas: set (command line) but not read: optim.name is sgd")
                                          for m in e.value.errors), e.value.errors


def test_mlflow_dir_is_read_with_mlflow(tmp_path):
    """logging.mlflow_dir is read where logging.trackers lists mlflow, and refused, naming the fix, where not."""
    store = str(tmp_path / "store")
    cfg = load_run_config(TINY, [f"output_dir={tmp_path}", "logging.trackers=[mlflow]", f"logging.mlflow_dir={store}"],
                          announce=False)
    assert cfg.logging.mlflow_dir == store
    with pytest.raises(ConfigError, match="logging.mlflow_dir: .*logging.trackers does not list mlflow. Add mlflow"):
        load_run_config(TINY, [f"output_dir={tmp_path}", f"logging.mlflow_dir={store}"], announce=False)
