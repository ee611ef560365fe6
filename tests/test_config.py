"""Config loading: schema errors, semantic errors, bases and overrides."""

import pytest

from mtl.config import load_config, parse_overrides
from mtl.errors import ConfigError
from mtl.validate import load_run_config

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
    ("data.max_caption_tokens=40", "data.max_caption_tokens"),
    ("tasks=[cls, cls]", "tasks"),
    ("tasks=[cls, nope]", "tasks"),
    ("ddp.static_graph=true", "ddp.static_graph"),
    ("ddp.find_unused_parameters=true", "ddp.find_unused_parameters"),
    ("data.source=manifest", "data.train_path"),
    ("weighting.method=static", "weighting.weights"),
    ("resume=/does/not/exist", "resume"),
    ("model.backbone.norm=layer", "model.backbone.norm"),
])
def test_semantic_errors_name_the_key(override, key):
    errs = errors_of(TINY, [override])
    assert any(e.startswith(key) for e in errs), errs


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
