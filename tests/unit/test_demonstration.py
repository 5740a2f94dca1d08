"""Demonstrations' edits: the smallest unique `search_replace` calls, split into turns a capped
policy can write (evals/demonstration.py). The task is a stand-in with only what the functions
read (a repo folder and a reference patch)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from opencomposer.evals.demonstration import in_turns, minimal_edits, shown_by_search

CODE = 'def enc(s):\n    return _enc(s)\nenc.__doc__ = "x"\n\n\ndef use():\n    return enc(1)\n\n\ndef other():\n    return enc(1)\n'
PATCH = """diff --git a/m.py b/m.py
--- a/m.py
+++ b/m.py
@@ -1,11 +1,11 @@
-def enc(s):
+def enc_v2(s):
     return _enc(s)
-enc.__doc__ = "x"
+enc_v2.__doc__ = "x"
 
 
 def use():
-    return enc(1)
+    return enc_v2(1)
 
 
 def other():
-    return enc(1)
+    return enc_v2(1)
"""


def _task(tmp_path, code=CODE, patch=PATCH):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "m.py").write_text(code)
    return SimpleNamespace(repo=tmp_path / "repo", reference_patch=patch, prompt="Rename `enc` in `m.py` to `enc_v2`.")


def _apply(code: str, calls: list[dict]) -> str:
    for c in calls:
        a = c["arguments"]
        assert code.count(a["old_string"]) == 1, a  # each call applies as search_replace requires
        code = code.replace(a["old_string"], a["new_string"])
    return code


def test_each_changed_run_is_its_own_edit_widened_only_until_unique(tmp_path):
    task = _task(tmp_path)
    edits = minimal_edits(task)
    olds = [(c["arguments"]["old_string"], bare) for c, bare in edits]
    # the unchanged `return _enc(s)` between the first two changes is not part of either edit
    assert olds[:2] == [("def enc(s):\n", True), ('enc.__doc__ = "x"\n', True)]
    # `return enc(1)` is there twice: the first is widened by context until unique; once it is
    # edited, the second is unique in the file as that edit left it
    assert [bare for _, bare in olds[2:]] == [False, True] and all("return enc(1)\n" in o for o, _ in olds[2:])
    assert _apply(CODE, [c for c, _ in edits]) == CODE.replace("enc(", "enc_v2(").replace("enc.__", "enc_v2.__") \
        .replace("_enc_v2(", "_enc(")
    # widened edits show lines the search for the name does not: the demonstration reads first
    assert shown_by_search(task, "enc") is None


def test_a_search_shows_every_edit_when_each_changed_line_is_unique(tmp_path):
    code = CODE.replace("def other():\n    return enc(1)\n", "def other():\n    return enc(2)\n")
    patch = PATCH.replace(" def other():\n-    return enc(1)\n+    return enc_v2(1)\n",
                          " def other():\n-    return enc(2)\n+    return enc_v2(2)\n")
    task = _task(tmp_path, code, patch)
    calls = shown_by_search(task, "enc")
    assert [c["arguments"]["old_string"] for c in calls] == ["def enc(s):\n", 'enc.__doc__ = "x"\n',
                                                             "    return enc(1)\n", "    return enc(2)\n"]
    assert "def enc_v2(s):\n    return _enc(s)\nenc_v2.__doc__" in _apply(code, calls)


def test_edits_are_split_into_turns_of_bounded_size():
    calls = [{"name": "search_replace", "arguments": {"file_path": "m.py", "old_string": "x" * n, "new_string": "y"}}
             for n in (10, 10, 300, 10)]
    sizes = [[len(json.dumps(c["arguments"])) for c in turn] for turn in in_turns(calls, 150)]
    assert [len(t) for t in sizes] == [2, 1, 1] and all(sum(t) <= 150 for t in sizes if len(t) > 1)
    assert [c for t in in_turns(calls, 150) for c in t] == calls  # order kept, nothing lost
    assert in_turns(calls, None) == [calls] and in_turns([], 100) == []


def test_span_edits_copy_the_smallest_unique_part_of_a_line(tmp_path):
    code = ('__all__ = ["enc", "unenc"]\n\n\nclass C:\n    def enc(self, s):\n        return s\n\n'
            '    def unenc(self, s):\n        return self.enc(s)[::-1]\n\n\nx = C.enc(C(), 1)\n')
    new = code.replace('"enc"', '"enc_v2"').replace("def enc(", "def enc_v2(").replace(".enc(", ".enc_v2(")
    patch = ("diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1,12 +1,12 @@\n"
             + "".join(f"-{a}\n+{b}\n" if a != b else f" {a}\n" for a, b in zip(code.splitlines(), new.splitlines())))
    task = _task(tmp_path, code, patch)
    calls = minimal_edits(task, spans=True)
    # each old text is a few tokens of the changed line, dressed as code is read (quotes, `def`, the
    # call's parenthesis) and grown only until unique: `.enc(` is there twice
    assert [(c["arguments"]["old_string"], c["arguments"]["new_string"]) for c, _ in calls] == [
        ('"enc"', '"enc_v2"'), ("def enc(", "def enc_v2("), ("self.enc(", "self.enc_v2("),
        ("C.enc(", "C.enc_v2(")] and all(bare for _, bare in calls)
    assert _apply(code, [c for c, _ in calls]) == new
    # the lines themselves are the default, and a search for the name shows every span's line
    assert [c["arguments"]["old_string"] for c, _ in minimal_edits(task)][1] == "    def enc(self, s):\n"
    assert shown_by_search(task, "enc", spans=True) == [c for c, _ in calls]


def test_a_span_falls_back_to_the_lines_when_no_part_of_the_line_is_unique(tmp_path):
    code = "a = 1\nb = f(1)\nc = 2\nb = f(1)\n"
    patch = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,3 @@\n a = 1\n-b = f(1)\n+b = g(1)\n c = 2\n"
    (call, bare), = minimal_edits(_task(tmp_path, code, patch), spans=True)
    # the changed line is there twice, so no part of it is unique: the line widened by context, as without spans
    assert call["arguments"]["old_string"] == "b = f(1)\nc = 2\n" and not bare
    assert _apply(code, [call]) == "a = 1\nb = g(1)\nc = 2\nb = f(1)\n"
