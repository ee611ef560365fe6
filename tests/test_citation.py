"""CITATION.cff is a valid Citation File Format 1.2.0 file that agrees with pyproject.toml (version, licence)."""

from __future__ import annotations

import os

import tomllib
import yaml

from .conftest import ROOT


def test_the_citation_file_agrees_with_the_package():
    with open(os.path.join(ROOT, "CITATION.cff"), encoding="utf-8") as f:
        cff = yaml.safe_load(f)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    for key in ("message", "title", "authors"):  # the keys CFF 1.2.0 requires
        assert cff[key], key
    assert all("name" in a or "family-names" in a for a in cff["authors"])
    assert cff["version"] == project["version"] and cff["license"] == project["license"]
    import mtl

    assert mtl.__version__ == project["version"]  # the package says the version it is cited by
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "## How to cite" in f.read()
