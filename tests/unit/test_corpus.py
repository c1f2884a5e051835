"""The offline training text: standard-library docstrings and packages' documentation, split without
overlap, with license texts kept out by name and by wording."""

from __future__ import annotations

import pytest

from kvtier.training.corpus import corpus_prose, is_legal_text, looks_like_prose, package_prose


@pytest.mark.parametrize("name, text", [
    ("pkg/LICENSE.txt", "any words at all"),
    ("pkg/COPYING", "any words at all"),
    ("pkg/docs/license.rst", "any words at all"),
    ("pkg/NOTICE.md", "any words at all"),
    ("pkg/readme.md", "This program is free software under the GNU General Public License version 3."),
    ("pkg/guide.md", "Permission is hereby granted, free of charge, to any person obtaining a copy"),
    ("pkg/intro.rst", "Licensed under the Apache License, Version 2.0 (the License)"),
    ("pkg/notes.txt", "Permission is granted to copy under the terms of the GNU Free Documentation License"),
])
def test_license_texts_are_recognised(name, text):
    assert is_legal_text(name, text)


def test_every_license_the_system_ships_is_recognised_by_its_wording():
    """Each license text the OS ships, under a name that says nothing (the Artistic license's "MERCHANTIBILITY"
    had slipped through). The texts are only checked here, never read as training text."""
    import os

    folder = "/usr/share/common-licenses"
    if not os.path.isdir(folder):
        pytest.skip(f"no {folder} on this system")
    names = sorted(os.listdir(folder))
    missed = [n for n in names if os.path.isfile(os.path.join(folder, n)) and not is_legal_text(
        "pkg/docs/terms.txt", open(os.path.join(folder, n), encoding="utf-8", errors="replace").read())]
    assert names and not missed


def test_ordinary_documentation_is_not_legal_text():
    assert not is_legal_text("pkg/README.md", "This package reads files. It is fast. Use it like this.")


def test_prose_is_told_from_data():
    prose = "A cache keeps entries. It moves the rest to the host when memory runs short.\n" * 40
    assert looks_like_prose(prose)
    assert not looks_like_prose("\n".join(f"xn--{i}" for i in range(500)))


def test_package_documentation_splits_apart_and_holds_no_license_text():
    train, held = package_prose("train"), package_prose("eval")
    assert not {n for n, _ in train} & {n for n, _ in held}
    for name, text in train + held:
        assert not is_legal_text(name, text), name
        assert ".dist-info/" not in name


def test_corpora_name_their_sources():
    both = corpus_prose("both", "eval")
    assert any(n.startswith("stdlib:") for n, _ in both)
    assert {n.split(":")[0] for n, _ in both} <= {"stdlib", "package"}
    with pytest.raises(ValueError, match="corpus='web'"):
        corpus_prose("web", "train")
