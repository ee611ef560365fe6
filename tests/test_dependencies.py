"""pyproject.toml declares ranges; constraints.txt holds the exact versions make and CI install. Every lower
bound a range declares must be the version that is pinned (and so tested), and every pin must lie in its range."""

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def _pins():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_every_declared_dependency_has_a_range_whose_lower_bound_is_its_pin():
    pins = _pins()
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned in constraints.txt"
        assert not any(s.operator == "==" for s in req.specifier), f"{req}: declare a range, not an exact pin"
        lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert lower == [pins[name]], f"{req}: its lower bound must be the tested pin {pins[name]}"
        assert req.specifier.contains(pins[name]), f"{req} does not admit its pin {pins[name]}"


def test_the_licence_is_declared_and_shipped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text().splitlines()[0]
