from __future__ import annotations

from opencomposer.harness import prompt
from opencomposer.harness.index import CodeIndex, tokenize


def test_tokenize_splits_identifiers():
    toks = tokenize("parseHTTPRequest snake_case_name x1")
    assert {"parsehttprequest", "parse", "http", "request", "snake", "case", "name"} <= set(toks)


def test_bm25_ranks_the_defining_file_first(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "net.py").write_text("def parse_http_request(raw):\n    headers = {}\n    return headers\n")
    (tmp_path / "b.py").write_text("def unrelated():\n    return 42\n" * 30)
    (tmp_path / "c.md").write_text("notes about cooking\n")
    idx = CodeIndex.build(tmp_path)
    hits = idx.search("where is the HTTP request parsed")
    assert hits and hits[0].path == "a/net.py" and hits[0].start == 1
    assert idx.search("parse", dirs=["b.py"]) == []
    idx.update("/workspace/b.py", "def parse_http_request_v2(): pass\n")
    assert {h.path for h in idx.search("parse http request")} == {"a/net.py", "b.py"}
    idx.remove("a/net.py")
    assert [h.path for h in idx.search("parse http request")] == ["b.py"]


def test_summary_extraction():
    assert prompt.extract_summary("<scratchpad>think</scratchpad>\n<summary>did X</summary>") == "did X"
    assert prompt.extract_summary("<scratchpad>think</scratchpad> plain") == "plain"
    assert prompt.extract_summary(None) == ""


def test_task_message_layout():
    m = prompt.task_message("fix it", recent=["a.py"], history=["earlier ask"], summary="S", todos="[ ] 1: x",
                            summaries=2)
    c = m["content"]
    assert m["role"] == "user"
    assert c.index("<recent_files>") < c.index("<previous_user_messages>") < c.index("<summary_of_earlier_work")
    assert c.index("<todos>") < c.index("<user_query>") and 'count="2"' in c and c.rstrip().endswith("</user_query>")


def test_working_style_names_only_the_tools_the_agent_has():
    from opencomposer.harness.tools import ALL_TOOLS

    full = prompt.system_message("/workspace", "")["content"]
    assert prompt.system_message("/workspace", "", tuple(t.name for t in ALL_TOOLS))["content"] == full
    for name in ("codebase_search", "glob_file_search", "write_file", "read_lints", "todo_write"):
        assert name in full
    four = ("grep", "read_file", "search_replace", "run_terminal_cmd")
    text = prompt.system_message("/workspace", "", four)["content"]
    assert "- Find the relevant code first (grep, read_file), then edit it (search_replace for edits), then check " \
           "your work (run the tests or the program with run_terminal_cmd)." in text
    for absent in ("codebase_search", "glob_file_search", "write_file", "read_lints", "todo_write"):
        assert absent not in text
    assert prompt.working_style(["search_replace"]).startswith("- Edit it (search_replace for edits).")
    assert prompt.working_style([]).startswith("- Follow the conventions")
