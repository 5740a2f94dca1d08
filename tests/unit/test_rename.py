"""The rename builder's pure parts: a rename by token, and which definitions are candidates."""

from __future__ import annotations

import random

from opencomposer.tasks.builders.rename import new_name, rename_candidates, rename_identifier, rename_sites

SRC = '''"""Docs mention area_of here and must keep it."""
__all__ = ["area_of", 'other']

def area_of(r):  # area_of: a comment stays
    return 3 * r * r

def other(r):
    s = "area_of is a word in this string"
    return area_of(r) + area_of_x(r) + obj.area_of
'''


def test_rename_by_token_changes_names_and_exact_strings_only():
    out = rename_identifier(SRC, "area_of", "disc_area")
    assert '__all__ = ["disc_area", \'other\']' in out
    assert "def disc_area(r):  # area_of: a comment stays" in out
    assert "return disc_area(r) + area_of_x(r) + obj.disc_area" in out  # a longer name is another name
    assert '"""Docs mention area_of here' in out and '"area_of is a word in this string"' in out
    assert rename_identifier(out, "disc_area", "area_of") == SRC  # nothing else moved, byte for byte
    assert rename_identifier("def broken(:\n  '''", "broken", "x") == "def broken(:\n  '''"  # no tokens, no change


def test_candidates_are_public_defined_once_used_by_tests_and_not_too_short():
    code = {"a.py": "def area_of(r): pass\ndef _private(): pass\ndef split(): pass\nclass Shape:\n"
                    "    def perimeter(self): pass\n",
            "b.py": "def twice(): pass\ndef twice_(): pass\nclass Other:\n    def perimeter(self): pass\n"}
    tests = {"test_a.py": "from a import *\narea_of(1); _private(); split(); Shape().perimeter(); twice()"}
    got = {(f, q) for f, q, _ in rename_candidates(code, tests, random.Random(0))}
    # _private is private, split is str.split's name too, perimeter defined twice, twice_ unused by the tests
    assert got == {("a.py", "area_of"), ("a.py", "Shape"), ("b.py", "twice")}
    taken = {"area_of_v2", "compute_area_of"}
    assert new_name("area_of", random.Random(1), taken) == "area_of_impl"
    assert new_name("Shape", random.Random(1), set()).startswith(("Shape", "Base"))
    assert new_name("x", random.Random(0), {"x_v2", "compute_x", "x_impl"}) is None


def test_rename_sites_counts_the_places_a_rename_changes():
    # in SRC: the __all__ entry, the definition, and the call in `other` and `obj.area_of` (comments,
    # docstrings, other strings and `area_of_x` are not places a rename by token changes)
    assert rename_sites({"a.py": SRC}, "area_of") == 4
    assert rename_sites({"a.py": SRC, "b.py": "from a import area_of\narea_of(2)\n"}, "area_of") == 6
    assert rename_sites({"a.py": SRC}, "missing") == 0
    assert rename_sites({"a.py": "def broken(:\n  \'\'\'"}, "broken") == 0  # does not tokenize: nothing renamed
    # the count is what `rename_identifier` changes, token for token
    changed = rename_identifier(SRC, "area_of", "Z")
    assert changed.count("Z") == rename_sites({"a.py": SRC}, "area_of")
