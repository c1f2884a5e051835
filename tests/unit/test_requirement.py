"""The releases kvtier accepts: what pyproject.toml asks pip for, what kvtier checks of transformers at import and
what CI runs the tests on are the same bounds."""

import re
import warnings
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from kvtier.integrations.requirement import TRANSFORMERS_BELOW, TRANSFORMERS_OLDEST, check_transformers

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_asks_for_the_bounds_kvtier_checks():
    specs = re.findall(r'"transformers([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert specs == [f">={TRANSFORMERS_OLDEST},<{TRANSFORMERS_BELOW}"]


def test_ci_runs_the_tests_on_the_oldest_release_of_every_dependency():
    """Every lower bound of pyproject.toml is a release CI installs (torch's aside: CI takes the CPU build on disk)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([0-9.]+)"', (ROOT / ".ci" / "run").read_text()))
    floors = [req for req in project["dependencies"] + project["optional-dependencies"]["test"] if ";" not in req]
    assert len(floors) > 5
    for req in floors:
        name, oldest = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(?:,<[0-9.]+)?", req).groups()
        if name != "torch":
            assert name in pinned and Version(pinned[name]) == Version(oldest), (req, pinned.get(name))


@pytest.mark.parametrize("version", ["5.5.4", "5.12.1", "5.16.1", "4.57.6"])
def test_an_older_release_is_refused_with_what_to_install(version):
    with pytest.raises(ImportError) as e:
        check_transformers(version)
    message = str(e.value)
    assert f"transformers {version}" in message
    assert f"pip install 'transformers>={TRANSFORMERS_OLDEST},<{TRANSFORMERS_BELOW}'" in message


@pytest.mark.parametrize("version", [f"{TRANSFORMERS_OLDEST}.0", f"{TRANSFORMERS_OLDEST}.0.dev0", "5.25.0",
                                     transformers.__version__, "a-build-of-its-own"])
def test_a_release_in_range_passes_quietly(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_transformers(version)


def test_a_next_major_release_is_taken_with_a_warning():
    with pytest.warns(UserWarning, match=r"transformers 6\.0\.0 is newer than kvtier was tested with"):
        check_transformers("6.0.0")
