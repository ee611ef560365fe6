"""A mistyped weighting method gets a "did you mean", and ``train.py --help``
describes every key (a comment after the field, or the comment block above it) and each method's options."""

from __future__ import annotations

import os
import re

import pytest
import yaml
from omegaconf import OmegaConf

import train
from mtl.registry import PLUGIN_KEYS

from .conftest import ROOT, TINY


def test_a_mistyped_weighting_method_gets_the_nearest_name(tmp_path, capsys):
    assert train.main(["--config", TINY, "weighting.method=cagrd", f"output_dir={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert "weighting.method: unknown method 'cagrd' — did you mean 'cagrad'?" in err, err


def test_help_describes_the_keys_documented_above_their_field(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = capsys.readouterr().out
    lines = {x.split()[0]: x for x in out.splitlines() if x.startswith("  ") and x.split()}
    for key, says in [("data.per_task", "multi-input: each task its own data set"),
                      ("loss_scale", "factor on its training loss"), ("data.heldout", "held out for a bilevel"),
                      ("optim.lr", "float = 0.001")]:
        assert says in lines[key], (key, lines[key])
    assert not any(k.startswith("bench.") for k in lines)  # the benchmark's keys: its own --help (below)
    # each weighting method's options with the comment of its Options dataclass
    options = out[out.index("weighting.options (method=<name>):"):]
    assert "    c: float = 0.4  # the radius of the ball around the average gradient" in options
    assert "  equal: (no options)" in options


def test_the_benchmark_s_help_describes_its_own_keys(capsys):
    from mtl.tools.bench.sweep import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    lines = {x.split()[0]: x for x in out.splitlines() if x.startswith("  ") and x.split()}
    for key, says in [("bench.regimes", "overrides: [key=value"), ("bench.heldout", "data.heldout of a bilevel"),
                      ("bench.slurm.partition", "null: the cluster's default partition"),
                      ("bench.reference.metrics", "task -> {metric: value}")]:
        assert says in lines[key], (key, lines[key])


def launch_refusal(tmp_path, capsys, monkeypatch, via_make: bool) -> tuple[int, str, list]:
    """``mtl.tools.launch`` as ``make train`` runs it, on a folder that holds a checkpoint: (exit code, stderr, the
    torchrun runs it started)."""
    import torch.distributed.run as torchrun

    from mtl.tools import launch

    out = tmp_path / "run"
    (out / "checkpoints" / "step_6").mkdir(parents=True)
    started = []
    monkeypatch.setattr(torchrun, "run", started.append)  # a worker started would be a run here
    if via_make:
        monkeypatch.setenv("MTL_MAKE_TARGET", "train")
    else:
        monkeypatch.delenv("MTL_MAKE_TARGET", raising=False)
    capsys.readouterr()
    code = launch.main(["--standalone", "--nproc_per_node=2", "train.py", "--config", TINY, "trainer.max_steps=9",
                        f"output_dir={out}"])
    return code, capsys.readouterr().err, started


def test_re_running_make_train_is_refused_before_the_workers_start_with_the_make_form(tmp_path, capsys, monkeypatch):
    code, err, started = launch_refusal(tmp_path, capsys, monkeypatch, via_make=True)
    assert code == 2 and started == [], err
    out = tmp_path / "run"
    assert "step_6" in err and "Traceback" not in err
    # the overrides go in make's ARGS, the ones already given kept
    assert f'make train ARGS="trainer.max_steps=9 output_dir={out} resume=auto"' in err, err
    assert f'make train ARGS="trainer.max_steps=9 output_dir={out} overwrite=true"' in err, err
    # and make tells the launcher so: its train target sets the variable the launcher reads
    with open(os.path.join(ROOT, "Makefile")) as f:
        recipe = f.read().split("\ntrain:", 1)[1].split("\n\n", 1)[0]
    assert "MTL_MAKE_TARGET=train" in recipe and "mtl.tools.launch" in recipe, recipe


def test_the_launcher_outside_make_gives_the_overrides_as_they_are(tmp_path, capsys, monkeypatch):
    code, err, started = launch_refusal(tmp_path, capsys, monkeypatch, via_make=False)
    assert code == 2 and started == [] and "make train" not in err, err
    assert "resume=auto" in err and "overwrite=true" in err


@pytest.mark.slow  # in-process, but seconds long: kept out of the fast tier
def test_without_a_terminal_the_progress_bar_is_a_plain_line_every_log_every_steps(tmp_path, capsys):
    capsys.readouterr()  # captured output is no terminal, as a log file or make's pipe
    code = train.main(["--config", TINY, "trainer.progress=true", "trainer.max_steps=6", "trainer.log_every=3",
                       "trainer.eval_every=100", f"output_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert "\r" not in out + err, err[-2000:]  # no bar frames
    progress = [line for line in out.splitlines() if line.startswith("progress: step ")]
    assert [line.split()[2] for line in progress] == ["3/6", "6/6"], out[-3000:]
    assert "loss_cls=" in progress[0] and "s/step" in progress[0], progress


def relative_path_rules() -> list[tuple[list[str], str, str]]:
    """docs/config.md's table of relative paths: (keys, in a config file relative to, on the command line relative
    to), one row each."""
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("<!-- relative-paths:begin -->"):text.index("<!-- relative-paths:end -->")]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()[3:]
            if line.startswith("|")]
    return [(re.findall(r"`([\w.]+)`", keys), in_file, on_line) for keys, in_file, on_line in rows]


def test_each_relative_path_key_resolves_as_docs_config_md_says_and_help_agrees(tmp_path, monkeypatch, capsys):
    """From a working directory other than the config file's folder: base: and the plug-in .py paths of a file, its
    output_dir and data paths, and the command line's, are read from where the table in docs/config.md says; and
    train.py --help says nothing else."""
    from mtl.config.schema import load_config

    rules = {key: (in_file, on_line) for keys, in_file, on_line in relative_path_rules() for key in keys}
    where = {"the file's folder": tmp_path / "conf", "the working directory": tmp_path / "work"}
    assert {"base", "output_dir", "data.train_path", *PLUGIN_KEYS} <= set(rules), rules
    assert {rule for pair in rules.values() for rule in pair} <= {*where, "(a file key only)"}, rules
    for folder in where.values():
        folder.mkdir()
    (where[rules["base"][0]] / "base.yaml").write_text("seed: 7\n")
    config = tmp_path / "conf" / "run.yaml"
    config.write_text(yaml.safe_dump({"base": "base.yaml", "output_dir": "out", "data": {"train_path": "t.jsonl"},
                                      **{key: [f"{key}.py"] for key in PLUGIN_KEYS}}))
    for key in PLUGIN_KEYS:  # the plug-in files exist where the rule reads them from
        (where[rules[key][0]] / f"{key}.py").write_text("")
    monkeypatch.chdir(tmp_path / "work")
    cfg = load_config(str(config))
    assert cfg.seed == 7  # base: found where the table says
    for key in ("output_dir", "data.train_path", *PLUGIN_KEYS):
        value = OmegaConf.select(cfg, key)
        value = value if isinstance(value, str) else value[0]
        assert os.path.abspath(value) == str(where[rules[key][0]] / os.path.basename(value)), (key, value)
    line = load_config(str(config), [f"{key}=[{key}_line.py]" for key in PLUGIN_KEYS] + ["output_dir=out2"])
    for key in ("output_dir", *PLUGIN_KEYS):
        value = OmegaConf.select(line, key)
        value = value if isinstance(value, str) else value[0]
        assert os.path.abspath(value) == str(where[rules[key][1]] / os.path.basename(value)), (key, value)
    # train.py --help: its --config line gives the same rule and points at the table; no key's line says otherwise
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "docs/config.md#relative-paths" in out and "base: and the *_modules .py files from the config file's folder" in out
    for key in PLUGIN_KEYS:
        said = re.search(rf" {key} .*?(?= \w+_modules | \w+\.\w+ |$)", out).group(0)
        assert "working directory" not in said or "from its folder" in said or "as task_modules" in said, said
