"""Config loading: schema errors, semantic errors, bases and overrides."""

import os

import pytest

from mtl.config.schema import load_config, parse_overrides
from mtl.errors import ConfigError
from mtl.setup.checks import load_run_config

from .conftest import TINY


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def errors_of(path, overrides=()):
    with pytest.raises(ConfigError) as e:
        load_run_config(path, list(overrides))
    assert e.value.exit_code == 2
    return e.value.errors


def test_tiny_builds_on_default():
    cfg = load_run_config(TINY)
    assert cfg.data.image_size == 32  # from tiny.yaml
    assert cfg.data.synthetic.max_count == 3  # inherited from default.yaml
    assert cfg.ddp.strategy == "feature_leaf"


def test_overrides_are_typed_yaml():
    cfg = load_run_config(TINY, ["trainer.max_steps=3", "resume=null", "tasks=[cls, gen]", "optim.lr=1e-2"])
    assert cfg.trainer.max_steps == 3 and cfg.resume is None and list(cfg.tasks) == ["cls", "gen"]
    assert cfg.optim.lr == pytest.approx(0.01)
    nested, errs = parse_overrides(["a.b.c=1", "nokey"])
    assert nested == {"a": {"b": {"c": 1}}} and len(errs) == 1 and "nokey" in errs[0]


def test_every_schema_error_is_reported_at_once_with_its_source(tmp_path):
    path = write(tmp_path, f"base: {TINY}\ndata:\n  batch_size: lots\n  bogus_key: 1\n")
    errs = errors_of(path, ["trainer.max_stepz=3", "seed=abc"])
    text = "\n".join(errs)
    assert len(errs) == 4
    assert f"{path}: data.batch_size" in text and "'lots'" in text
    assert f"{path}: data.bogus_key: unknown key 'bogus_key'" in text
    assert "command line: trainer.max_stepz: unknown key" in text and "max_steps" in text  # lists known keys
    assert "command line: seed" in text


def test_missing_and_unreadable_files(tmp_path):
    errs = errors_of(str(tmp_path / "nope.yaml"))
    assert "does not exist" in errs[0] and "nope.yaml" in errs[0]
    bad = write(tmp_path, "a: [1, 2\n")
    assert "not valid YAML" in errors_of(bad)[0]
    listy = write(tmp_path, "- 1\n- 2\n")
    assert "mapping" in errors_of(listy)[0]
    cyc = write(tmp_path, "base: c.yaml\n")
    assert "cycle" in errors_of(cyc)[0]


@pytest.mark.parametrize("override, key", [
    ("ddp.strategy=nope", "ddp.strategy"),
    ("weighting.method=nope", "weighting.method"),
    ("model.backbone.name=resnet9000", "model.backbone.name"),
    ("precision=fp8", "precision"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("data.batch_size=-1", "data.batch_size"),
    ("model.decoder.n_head=3", "model.decoder.n_embd"),
    ("task_options.gen.max_tokens=40", "task_options.gen.max_tokens"),
    ("data.max_caption_tokens=40", "task_options.gen.max_tokens"),  # the old name of the key
    ("tasks=[cls, cls]", "tasks"),
    ("tasks=[cls, nope]", "tasks"),
    ("ddp.static_graph=true", "ddp.static_graph"),
    ("ddp.find_unused_parameters=true", "ddp.find_unused_parameters"),
    ("data.source=manifest", "data.train_path"),
    ("weighting.method=static", "weighting.weights"),
    ("resume=/does/not/exist", "resume"),
    ("resume_reshard=true", "resume_reshard"),  # with resume=null: nothing to reshard (tests/test_reshard.py)
    ("model.backbone.norm=layer", "model.backbone.norm"),
])
def test_semantic_errors_name_the_key(override, key):
    errs = errors_of(TINY, [override])
    assert any(e.startswith(key) for e in errs), errs


def test_the_engine_under_its_old_name_still_reads_with_a_note(tmp_path, capsys, monkeypatch):
    """ddp.engine moved to parallel.engine: a config file or an override with the old name is read as the new key and
    says so, once per process; a checkpoint's config.yaml with it is read without a note (mtl wrote it, and it still
    resumes); the two names at odds are an error."""
    import yaml

    from mtl.config import load, schema
    from mtl.setup.resume import verify_resume_config

    monkeypatch.setattr(load, "_NOTED", set())  # the notes said so far in this process (mtl/config/load.py)
    monkeypatch.delenv("RANK", raising=False)
    old = write(tmp_path, f"base: {TINY}\nddp:\n  engine: fsdp2\n  strategy: combined\n")
    cfg = load_config(old)
    assert cfg.parallel.engine == "fsdp2" and "engine" not in cfg.ddp and cfg.ddp.strategy == "combined"
    load_config(old, ["trainer.max_steps=2"])
    err = capsys.readouterr().err
    assert err.count("ddp.engine is now parallel.engine") == 1 and old in err, err
    assert load_config(TINY, ["ddp.engine=fsdp2"]).parallel.engine == "fsdp2"
    assert "command line: ddp.engine is now parallel.engine" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"ddp.engine \(the old name\) and parallel.engine"):
        load_config(TINY, ["ddp.engine=fsdp2", "parallel.engine=ddp"])

    cfg = load_run_config(TINY, [f"output_dir={tmp_path}"])
    saved = yaml.safe_load(schema.to_yaml(cfg))  # a checkpoint's config.yaml from before the move
    saved["ddp"]["engine"] = saved.pop("parallel")["engine"]
    ckpt = tmp_path / "step_3"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(yaml.safe_dump(saved))
    verify_resume_config(str(ckpt), cfg)
    assert schema.config_from_data(saved, "config.yaml").parallel.engine == "ddp"
    assert "parallel.engine" not in capsys.readouterr().err


def test_known_bad_ddp_combinations_explain_why():
    # one shared forward with find_unused_parameters=True: refused with the reason
    errs = errors_of(TINY, ["ddp.strategy=feature_leaf", "ddp.find_unused_parameters=true"])
    assert "feature_leaf" in errs[0] and "false" in errs[0]
    errs = errors_of(TINY, ["ddp.strategy=accumulate", "ddp.find_unused_parameters=false"])
    assert "accumulate" in errs[0]
    errs = errors_of(TINY, ["ddp.strategy=find_unused", "ddp.static_graph=true"])
    assert "several backward passes" in errs[0]
    # combined tolerates both flags: one backward per forward
    load_run_config(TINY, ["ddp.strategy=combined", "ddp.static_graph=true"])


def test_load_config_alone_skips_semantic_checks():
    cfg = load_config(TINY, ["ddp.strategy=nope"])
    assert cfg.ddp.strategy == "nope"


# ---------------------------------------------------------------------------------------------
# a new user's mistakes: each one message naming the key and the fix


def test_key_type_and_value_errors_are_reported_together():
    errs = errors_of(TINY, ["trainer.bogus=1", "data.batch_size=0", "optim.lr=-1"])
    assert len(errs) == 3, errs
    assert any("trainer.bogus" in e and "unknown key" in e for e in errs)
    assert any(e.startswith("data.batch_size") for e in errs) and any(e.startswith("optim.lr") for e in errs)


@pytest.mark.parametrize("override, suggestion", [
    ("trainer.max_stepz=3", "trainer.max_steps"),
    ("batch_size=8", "data.batch_size"),  # a right name in the wrong section
    ("data.synthetc.train_size=8", "data.synthetic"),  # the section is what is misspelt
    ("model.backbone.norml=group", "model.backbone.norm"),
])
def test_a_mistyped_key_suggests_the_nearest_valid_one(override, suggestion):
    (err,) = errors_of(TINY, [override])
    assert f"did you mean {suggestion!r}?" in err, err


def test_base_file_not_found_says_which_relative_to_what(tmp_path):
    """A config copied out of configs/ keeps 'base: default.yaml', which now points next to the copy."""
    copy = write(tmp_path, open(TINY).read(), name="mine.yaml")
    (err,) = errors_of(copy)
    assert copy in err and str(tmp_path / "default.yaml") in err and "relative to" in err and str(tmp_path) in err
    assert "absolute path" in err and "--config" not in err


def test_synthetic_class_count_has_one_range(tmp_path):
    """The launcher's check (validate) and the data generator accept exactly the same class counts."""
    from mtl.data.synthetic import SHAPES, SyntheticShapes

    for n in range(0, len(SHAPES) + 3):
        try:
            SyntheticShapes(size=4, image_size=32, num_classes=n, max_count=1, noise=0, clutter=0, seed=0)
            generator_ok = True
        except ConfigError:
            generator_ok = False
        try:
            load_run_config(TINY, [f"data.synthetic.num_classes={n}"])
            validate_ok = True
        except ConfigError as e:
            assert any("data.synthetic.num_classes" in x for x in e.errors)
            validate_ok = False
        assert validate_ok == generator_ok, n
    assert not validate_ok  # the range really ends


def test_sync_batchnorm_on_the_cpu_is_a_config_error():
    errs = errors_of(TINY, ["model.backbone.norm=sync", "device=cpu"])
    assert errs[0].startswith("model.backbone.norm") and "CUDA" in errs[0] and "group" in errs[0]


def test_help_lists_the_config_keys(capsys):
    import train

    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for key, text in [("data.synthetic.num_classes", "int = 4"), ("model.backbone.norm", "batch | group"),
                      ("data.augment.hflip", "bool = false"), ("optim.lr", "float = 0.001")]:
        line = next((x for x in out.splitlines() if x.strip().startswith(key + " ")), "")
        assert text in line, (key, line)


def test_config_summary_shows_only_what_differs(tmp_path):
    from mtl.config.schema import config_summary, to_yaml

    cfg = load_run_config(TINY, ["trainer.num_beams=3"])
    text = config_summary(cfg, "runs/tiny/config.yaml")
    assert "runs/tiny/config.yaml" in text and "num_beams=3" in text and "batch_size=8" in text
    assert "bucket_cap_mb" not in text and "replica_check_every" not in text  # defaults are left out
    assert len(text.splitlines()) <= 10 < len(to_yaml(cfg).splitlines()) / 8


def test_a_method_s_options_are_checked_filled_and_used(tmp_path):
    """weighting.options is the method's own Options dataclass: defaults filled in, values typed, names checked."""
    from mtl.config.schema import to_yaml
    from mtl.setup.build import build_weighting

    cfg = load_run_config(TINY, ["ddp.strategy=task_grads", "weighting.method=cagrad"])
    assert dict(cfg.weighting.options) == {"c": 0.4, "rescale": True}  # the paper's defaults, saved in config.yaml
    assert "c: 0.4" in to_yaml(cfg)
    cfg = load_run_config(TINY, ["ddp.strategy=task_grads", "weighting.method=cagrad", "weighting.options.c=0.2"])
    assert build_weighting(cfg).options.c == pytest.approx(0.2)
    errs = errors_of(TINY, ["ddp.strategy=task_grads", "weighting.method=cagrad", "weighting.options.cc=0.2",
                            "weighting.options.rescale=maybe", "optim.lr=-1"])
    assert any("weighting.options: unknown option 'cc'" in e and "weighting.options.c'" in e for e in errs), errs
    assert any(e.startswith("weighting.options.rescale: bad value 'maybe'") for e in errs), errs
    assert any(e.startswith("optim.lr") for e in errs), errs  # reported together with the rest
    assert any("must be >= 0" in e for e in errors_of(TINY, ["ddp.strategy=task_grads", "weighting.method=cagrad",
                                                             "weighting.options.c=-1"]))


def test_task_options_name_only_configured_tasks_and_declared_keys(tmp_path):
    errs = errors_of(TINY, ["task_options.gne.max_tokens=1", "task_options.cls.nope=1"])
    assert any(e.startswith("task_options.gne: 'gne' is not a task — did you mean 'gen'?") for e in errs), errs
    assert any(e.startswith("task_options.cls: unknown option 'nope'") for e in errs), errs
    cfg = load_run_config(TINY)
    assert set(cfg.task_options) == set(cfg.tasks)  # every task's options, filled in
    # a single-task run of a 2-task config: options of a known task it does not train, set before tasks chose (in the
    # file; the command line is judged together), are dropped (set with or after it, refused: tests/test_unused_keys.py)
    cfg = load_run_config(write(tmp_path, f"base: {TINY}\ntask_options: {{gen: {{max_tokens: 5}}}}\n"), ["tasks=[cls]"])
    assert set(cfg.task_options) == {"cls"}
    errs = errors_of(TINY, ["tasks=[cls]", "task_options.gen.max_tokns=5"])  # ... after their check
    assert any(e.startswith("task_options.gen: unknown option 'max_tokns'") for e in errs), errs


# every method option and a value its check refuses (the range or the choice)
BAD_OPTION = {"cagrad": ("c", -1), "gradnorm": ("alpha", -0.5), "dwa": ("T", 0), "famo": ("lr", 0),
              "pcgrad": ("reduction", "avg"), "nashmtl": ("update_every", 0), "mgda": ("normalization", "l1"),
              "gradvac": ("beta", 1.5), "fairgrad": ("alpha", 0), "graddrop": ("leak", -0.1), "dbmtl": ("beta", 1.0),
              "excessmtl": ("eta", -1.0), "stch": ("mu", 0), "moco": ("beta", 0.0), "modo": ("gamma", 0.0),
              "sdmgrad": ("niter", 0), "autolambda": ("update_every", 0),
              "moml": ("fd_eps", 0.0), "forum": ("rho", 0.0), "uw": ("lr", -0.025)}


def test_each_method_s_options_are_checked_by_name_type_and_range():
    """For every method with options, what load_run_config runs on weighting.options (``check_options`` for names
    and types, the method's ``check`` for ranges), on the structured config without reading files; then the
    whole path once per kind of error, with exit code 2."""
    from omegaconf import OmegaConf

    from mtl.config.schema import Config, check_options
    from mtl.weighting import weighting_types

    cfg = OmegaConf.structured(Config)  # one config, its method and options set per case
    cfg.data.heldout = 32  # what the bilevel methods need (tests/test_bilevel.py); the others' checks do not read it

    def errors_for(method, options):
        cfg.weighting.method, cfg.weighting.options = method, options
        found: list[str] = []
        filled = check_options(options, weighting_types()[method].Options, "weighting.options", found)
        return found + weighting_types()[method].check(cfg), filled

    with_options = {m for m, cls in weighting_types().items() if cls.Options.__dataclass_fields__}
    assert with_options == set(BAD_OPTION), with_options ^ set(BAD_OPTION)  # every method with options is listed
    for method, (name, bad) in BAD_OPTION.items():
        errs, defaults = errors_for(method, {})
        assert errs == [] and set(defaults) == set(weighting_types()[method].Options.__dataclass_fields__), method
        errs, _ = errors_for(method, {name: bad})
        assert len(errs) == 1 and errs[0].startswith(f"weighting.options.{name}:"), (method, errs)
        errs, _ = errors_for(method, {name + "x": 1})  # an unknown name, with the nearest one
        assert len(errs) == 1 and errs[0].startswith("weighting.options: unknown option") and \
            f"weighting.options.{name}'" in errs[0], (method, errs)
        if isinstance(defaults[name], (int, float)):  # a wrong type names the key
            errs, _ = errors_for(method, {name: [1, 2]})
            assert len(errs) == 1 and errs[0].startswith(f"weighting.options.{name}: bad value"), (method, errs)
    # through load_run_config: exit code 2, every error at once
    errs = errors_of(TINY, ["ddp.strategy=task_grads", "weighting.method=fairgrad", "weighting.options.alpha=0"])
    assert errs == ["weighting.options.alpha: must be > 0 (got 0)"], errs
    errs = errors_of(TINY, ["weighting.method=stch", "weighting.options.mu=fast", "weighting.options.warmup=3"])
    assert any(e.startswith("weighting.options.mu: bad value 'fast'") for e in errs), errs
    assert any("unknown option 'warmup'" in e and "weighting.options.warmup_steps'" in e for e in errs), errs


# ------------------------------------------------------------------ NaN/inf and unresolvable values


def _float_keys():
    """Every float key of the schema, and every float option of every weighting method (with that method)."""
    from dataclasses import fields

    from mtl.config.schema import TaskDataConfig, config_keys
    from mtl.tasks import task_types
    from mtl.weighting import weighting_types

    keys = [([], k) for k, t, _, _ in config_keys() if t in ("float", "float | None", "Optional[float]")]
    keys += [([], k) for k, t, _, _ in config_keys() if t == "list[float]"]
    for name, cls in weighting_types().items():
        keys += [([f"weighting.method={name}"], f"weighting.options.{f.name}") for f in fields(cls.Options)
                 if f.type in (float, "float")]
    for name, cls in task_types().items():
        keys += [([f"tasks=[cls, {name}]"] if name != "cls" else [], f"task_options.{name}.{f.name}")
                 for f in fields(cls.Options) if f.type in (float, "float")]
    keys += [(["data.per_task.gen.source=synthetic"], f"data.per_task.cls.{f.name}") for f in fields(TaskDataConfig)
             if f.type in (float, "float")]
    return keys


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_nan_and_inf_are_refused_in_every_numeric_key():
    """NaN passes every range check (each comparison is false): each float key, each float option of each method
    and task, and a per-task data key, set to nan (inf and -inf: optim.lr) is an error naming the key."""
    keys = _float_keys()
    assert {"optim.lr", "optim.weight_decay", "optim.grad_clip", "data.synthetic.noise", "optim.betas",
            "data.per_task.cls.ratio"} <= {k for _, k in keys} and any(k.startswith("weighting.options.")
                                                                         for _, k in keys)
    missed = []
    for extra, key in keys:
        for bad in ("nan", "inf", "-inf") if key == "optim.lr" else ("nan",):
            value = f"[{bad}, {bad}]" if key in ("optim.betas", "data.augment.scale", "data.augment.ratio") else bad
            with pytest.raises(ConfigError) as e:
                load_run_config(TINY, [*extra, f"{key}={value}"])
            if not any(err.startswith(key) for err in e.value.errors):
                missed.append((key, bad, e.value.errors))
    assert missed == []


@pytest.mark.parametrize("override, key, says", [
    ("seed=${seed}", "seed", "Recursive interpolation"),
    ("output_dir=${oc.env:MTL_TEST_NOT_SET}", "output_dir", "MTL_TEST_NOT_SET"),
    ("optim.lr=nan", "optim.lr", "finite"),
    ("optim.betas=[2.0,0.999]", "optim.betas", "[0, 1)"),
])
def test_configs_that_ended_in_tracebacks_are_one_message(override, key, says):
    errs = errors_of(TINY, [override])
    assert len(errs) == 1 and errs[0].startswith(key) and says in errs[0], errs


def test_an_interpolation_that_gives_a_bad_value_never_shows_it(monkeypatch):
    monkeypatch.setenv("MTL_TEST_SECRET", "hunter2")
    (err,) = errors_of(TINY, ["seed=${oc.env:MTL_TEST_SECRET}"])
    assert err.startswith("seed:") and "hunter2" not in err and "${oc.env:MTL_TEST_SECRET}" in err
    monkeypatch.setenv("MTL_TEST_SECRET", "7")
    assert load_run_config(TINY, ["seed=${oc.env:MTL_TEST_SECRET}"]).seed == 7  # a good one still resolves


@pytest.mark.slow  # a real train.py process
def test_an_unresolvable_config_stops_before_anything_starts(tmp_path):
    from .conftest import run_train

    out = tmp_path / "run"
    proc = run_train(["--config", TINY, f"output_dir={out}", "seed=${seed}"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "seed: '${seed}'" in proc.stderr
    assert not out.exists()


def test_a_gradient_level_method_gets_the_strategy_that_serves_it_when_none_was_chosen(tmp_path, capsys):
    # tiny.yaml and its base default.yaml leave ddp.strategy at its default (feature_leaf), which gives a method
    # no per-task gradients of the parameters: task_grads is chosen, and one line says so
    cfg = load_run_config(TINY, ["weighting.method=pcgrad"])
    assert cfg.ddp.strategy == "task_grads"
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "ddp.strategy=task_grads, not the default feature_leaf" in lines[0]
    assert "weighting.method=pcgrad" in lines[0] and "Set ddp.strategy" in lines[0]
    load_run_config(TINY, ["weighting.method=pcgrad"], announce=False)
    assert capsys.readouterr().out == ""
    # a loss-level method, or the features source (which feature_leaf serves): nothing changes, nothing is said
    for over in (["weighting.method=uw"], ["weighting.method=mgda", "weighting.source=features"]):
        assert load_run_config(TINY, over).ddp.strategy == "feature_leaf"
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("where", ["command line", "config file", "base file"])
def test_a_strategy_the_user_named_is_never_replaced(tmp_path, capsys, where):
    base = write(tmp_path, f"base: {TINY}\n" + ("ddp: {strategy: feature_leaf}\n" if where == "base file" else ""),
                 "base.yaml")
    path = write(tmp_path, f"base: {base}\n" + ("ddp: {strategy: feature_leaf}\n" if where == "config file" else ""))
    over = ["weighting.method=pcgrad"] + (["ddp.strategy=feature_leaf"] if where == "command line" else [])
    (msg,) = [e for e in errors_of(path, over) if e.startswith("weighting.method=pcgrad needs")]
    assert "ddp.strategy=feature_leaf does not give; use ddp.strategy=task_grads" in msg
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ a user's YAML: anchors with a cap, no repeated key


@pytest.mark.timeout(60)  # a regression would expand the bomb: fail, not hang
def test_a_user_config_may_use_anchors_up_to_a_cap(tmp_path):
    from mtl.config.schema import USER_YAML_VALUES

    shared = write(tmp_path, f"base: {TINY}\nsteps: &n 3\ntrainer: {{max_steps: *n, eval_every: *n}}\n"
                             "optim: &o {lr: 0.01}\n", "anchors.yaml")
    assert "steps" in " ".join(errors_of(shared))  # anchors load; the helper key is an unknown key, as any
    merged = write(tmp_path, f"base: {TINY}\ntrainer: &t {{max_steps: 3}}\ncheckpoint: {{<<: *t}}\n", "merge.yaml")
    assert "checkpoint.max_steps" in " ".join(errors_of(merged))  # a merge key reads (and is checked) as its keys
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, 9)]  # 10^9 strings expanded
    bomb = write(tmp_path, "\n".join(lines) + "\n", "bomb.yaml")
    (err,) = errors_of(bomb)
    assert "bomb.yaml" in err and f"more than {USER_YAML_VALUES:,} values" in err, err
    nested = "x: &x [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]" + "".join(  # 111,111 values: over the cap on one command line
        f", {b}: &{b} [{', '.join([f'*{a}'] * 10)}]" for a, b in zip("xyzw", "yzwv"))
    (err,) = errors_of(TINY, [f"data.per_task={{{nested}}}"])
    assert err.startswith("command line: data.per_task: it expands to more than"), err
    cyclic = write(tmp_path, "a: &a [*a]\n", "cyclic.yaml")
    assert "more than" in errors_of(cyclic)[0]


def test_a_key_repeated_in_a_user_config_is_refused_naming_both_lines(tmp_path):
    path = write(tmp_path, f"base: {TINY}\ntrainer:\n  max_steps: 3\n  eval_every: 1\n  max_steps: 5\n")
    (err,) = errors_of(path)
    assert "c.yaml" in err and "lines 3 and 5: key 'max_steps' appears twice in one mapping" in err, err
    (err,) = errors_of(TINY, ["trainer={max_steps: 3, max_steps: 4}"])
    assert err.startswith("command line: trainer: key 'max_steps' appears twice"), err


def test_every_shipped_config_loads_with_the_stricter_reader():
    import glob

    from mtl.config.schema import read_config_chain

    for path in sorted(glob.glob(os.path.join(os.path.dirname(TINY), "*.yaml"))):
        assert read_config_chain(path), path
