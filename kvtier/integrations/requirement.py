"""The transformers releases kvtier works with, checked where kvtier first imports transformers.

An older release fails far from its cause (releases before 5.14 lack a cache helper kvtier calls at a cache's first
prefill, so the error is an ImportError from inside `model.generate`), and pip leaves an older transformers
in place when kvtier is installed with ``--no-deps`` or into an environment that pins it. The bounds are those of
pyproject.toml (a test keeps them equal); CI runs the tests on the oldest and on the newest release in them.
"""

from __future__ import annotations

import warnings

from packaging.version import InvalidVersion, Version

TRANSFORMERS_OLDEST = "5.17"   # the oldest release the tests run on
TRANSFORMERS_BELOW = "6"       # the next major release, untested


def check_transformers(version: str) -> None:
    """Refuse a transformers release older than `TRANSFORMERS_OLDEST`; warn of one from `TRANSFORMERS_BELOW` on."""
    try:
        found = Version(version)
    except InvalidVersion:   # a build of its own: nothing to compare, taken as it is
        return
    wanted = f"transformers>={TRANSFORMERS_OLDEST},<{TRANSFORMERS_BELOW}"
    if found.release < Version(TRANSFORMERS_OLDEST).release:
        raise ImportError(f"kvtier needs {wanted}; this environment has transformers {version}: "
                          f"pip install '{wanted}'")
    if found.release >= Version(TRANSFORMERS_BELOW).release:
        warnings.warn(f"transformers {version} is newer than kvtier was tested with ({wanted}); its cache and "
                      "attention interfaces may have changed", stacklevel=3)
