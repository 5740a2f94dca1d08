"""File tools: read_file, list_dir, glob_file_search, write_file, delete_file, search_replace.

All file access goes through the sandbox's tool server; paths are workspace-relative (absolute
paths inside the workspace also work; anything outside is refused by the server)."""

from __future__ import annotations

import fnmatch

from opencomposer.harness.schedule import Access
from opencomposer.harness.tools.base import Tool, ToolContext, ToolError
from opencomposer.sandbox.base import ToolCallError


def _text(ctx: ToolContext, path: str) -> str:
    data = ctx.sandbox.read_file(path, length=ctx.config.read_max_bytes)
    if b"\x00" in data[:8192]:
        raise ToolError(f"{path} is a binary file ({len(data)} bytes); it cannot be shown as text", "BinaryFile")
    return data.decode("utf-8", "replace")


def read_file(ctx: ToolContext, a: dict) -> str:
    path = a["target_file"]
    text = _text(ctx, path)
    lines = text.splitlines()
    if not lines:
        return f"{path} is empty."
    offset = max(1, a.get("offset", 1))
    limit = a.get("limit") or ctx.config.read_default_lines
    if offset > len(lines):
        raise ToolError(f"offset {offset} is past the end of {path} ({len(lines)} lines)", "InvalidArguments")
    chunk = lines[offset - 1: offset - 1 + limit]
    body = "\n".join(f"{i:6}|{line}" for i, line in enumerate(chunk, start=offset))
    end = offset + len(chunk) - 1
    if offset > 1 or end < len(lines):
        body += f"\n[lines {offset}-{end} of {len(lines)}; use offset/limit to read more]"
    return body


def list_dir(ctx: ToolContext, a: dict) -> str:
    path = a.get("target_directory") or "."
    ignore = a.get("ignore_globs") or []
    entries = [e for e in ctx.sandbox.list_dir(path)
               if e.name != ".git" and not any(fnmatch.fnmatch(e.name, g) for g in ignore)]
    if not entries:
        return f"{path} is empty."
    entries.sort(key=lambda e: (e.type != "dir", e.name))
    cap = ctx.config.max_results
    lines = [f"{e.name}/" if e.type == "dir" else f"{e.name} ({e.size} bytes)" if e.type == "file"
             else f"{e.name} [{e.type}]" for e in entries[:cap]]
    if len(entries) > cap:
        lines.append(f"[... {len(entries) - cap} more entries]")
    return "\n".join(lines)


def _rg(ctx: ToolContext, args: list[str], timeout_s: float = 60.0):
    r = ctx.sandbox.exec(["rg", "--color=never", "--hidden", "-g", "!.git", *args], timeout_s=timeout_s)
    if r.killed_by:
        raise ToolError(f"search stopped ({r.killed_by}) after {r.duration_s:.1f}s", "Timeout")
    if r.exit_code == 2 and r.stderr:
        raise ToolError(r.stderr.strip().splitlines()[-1][:500], "SearchError")
    return r


def glob_file_search(ctx: ToolContext, a: dict) -> str:
    pattern = a["glob_pattern"]
    where = a.get("target_directory") or "."
    # rg's own -g overrides .gitignore, so list with rg (ignore rules applied) and match here.
    r = _rg(ctx, ["--files"] + ([] if where in (".", "./") else ["--", where]))
    files = sorted(f for f in r.stdout.splitlines() if _glob_match(f, pattern))
    if not files:
        return f"No files match {pattern!r} under {where}."
    cap = ctx.config.max_results
    more = f"\n[... {len(files) - cap} more files]" if len(files) > cap else ""
    return "\n".join(files[:cap]) + more


def _glob_match(path: str, pattern: str) -> bool:
    """Glob semantics of editors: a pattern without '/' matches the file name at any depth; one with
    '/' matches the whole relative path ('**/' matching zero or more directories)."""
    path = path.removeprefix("./")
    if "/" not in pattern.strip("/"):
        return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern.strip("/"))
    pattern = pattern.removeprefix("./").removeprefix("/")
    return fnmatch.fnmatchcase(path, pattern) or (pattern.startswith("**/") and _glob_match(path, pattern[3:])) \
        or ("/**/" in pattern and fnmatch.fnmatchcase(path, pattern.replace("/**/", "/", 1)))


def write_file(ctx: ToolContext, a: dict) -> str:
    path, contents = a["file_path"], a["contents"]
    ctx.sandbox.write_file(path, contents)
    if ctx.index is not None:
        ctx.index.update(path, contents)
    return f"Wrote {len(contents.encode())} bytes to {path}."


def delete_file(ctx: ToolContext, a: dict) -> str:
    path = a["target_file"]
    ctx.sandbox.delete(path)
    if ctx.index is not None:
        ctx.index.remove(path)
    return f"Deleted {path}."


def matched_prefix(old: str, text: str) -> int:
    """The length of the longest prefix of `old` that occurs in `text`: where a copy that matched
    nothing departs from the file (RL's copy blame, `rl/copy_blame.py`). Occurring is monotone in the
    prefix's length, so a binary search: about log2(len(old)) substring searches."""
    lo, hi = 0, len(old)  # old[:lo] occurs; old[:hi + 1] is past the end or does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if old[:mid] in text:
            lo = mid
        else:
            hi = mid - 1
    return lo


def search_replace(ctx: ToolContext, a: dict) -> str:
    path, old, new = a["file_path"], a["old_string"], a["new_string"]
    if old == new:
        raise ToolError("old_string and new_string are identical; nothing to change", "InvalidArguments")
    try:
        text = _text(ctx, path)
    except ToolCallError as e:
        if e.type == "NotFound" and old == "":
            return write_file(ctx, {"file_path": path, "contents": new})  # an empty old_string creates the file
        raise
    if old == "":
        raise ToolError(f"{path} exists; an empty old_string only creates new files", "InvalidArguments")
    count = text.count(old)
    if count == 0:
        hint = " (it matches if whitespace is ignored: copy the exact indentation)" \
            if " ".join(old.split()) in " ".join(text.split()) else ""
        raise ToolError(f"old_string not found in {path}{hint}", "NoMatch", {"matched": matched_prefix(old, text)})
    if count > 1 and not a.get("replace_all"):
        raise ToolError(f"old_string occurs {count} times in {path}; include more surrounding context to make it "
                        "unique, or set replace_all=true", "NotUnique")
    updated = text.replace(old, new) if a.get("replace_all") else text.replace(old, new, 1)
    ctx.sandbox.write_file(path, updated)
    if ctx.index is not None:
        ctx.index.update(path, updated)
    line = text[: text.index(old)].count("\n") + 1
    lines = updated.splitlines()
    lo, hi = max(0, line - 3), min(len(lines), line + new.count("\n") + 3)
    snippet = "\n".join(f"{i + 1:6}|{lines[i]}" for i in range(lo, hi))
    return f"Replaced {count if a.get('replace_all') else 1} occurrence(s) in {path}:\n{snippet}"


TOOLS = [
    Tool("read_file", "Read a file of the workspace, with line numbers. Reads up to 2000 lines from `offset` "
         "(1-based) unless `limit` says otherwise.",
         {"type": "object", "properties": {
             "target_file": {"type": "string", "description": "Path relative to the workspace root."},
             "offset": {"type": "integer", "minimum": 1, "description": "First line to read (1-based)."},
             "limit": {"type": "integer", "minimum": 1, "description": "Number of lines to read."}},
          "required": ["target_file"]}, read_file, lambda a: Access(reads=(a.get("target_file"),))),
    Tool("list_dir", "List a directory of the workspace (directories first).",
         {"type": "object", "properties": {
             "target_directory": {"type": "string", "description": "Directory relative to the workspace root."},
             "ignore_globs": {"type": "array", "items": {"type": "string"}, "description": "Names to hide."}},
          "required": []}, list_dir, lambda a: Access(reads=(a.get("target_directory") or ".",))),
    Tool("glob_file_search", "Find files by glob pattern (e.g. '*.py', 'src/**/test_*.py'), respecting "
         ".gitignore.",
         {"type": "object", "properties": {
             "glob_pattern": {"type": "string"},
             "target_directory": {"type": "string", "description": "Where to search (default: workspace root)."}},
          "required": ["glob_pattern"]}, glob_file_search,
         lambda a: Access(reads=(a.get("target_directory") or ".",))),
    Tool("write_file", "Create or overwrite a file with the given contents.",
         {"type": "object", "properties": {
             "file_path": {"type": "string"}, "contents": {"type": "string", "allow_empty": True}},
          "required": ["file_path", "contents"]}, write_file, lambda a: Access(writes=(a.get("file_path"),))),
    Tool("delete_file", "Delete a file.",
         {"type": "object", "properties": {"target_file": {"type": "string"}}, "required": ["target_file"]},
         delete_file, lambda a: Access(writes=(a.get("target_file"),))),
    Tool("search_replace", "Replace an exact string in a file. old_string must occur exactly once unless "
         "replace_all is true; include enough surrounding lines to make it unique. An empty old_string "
         "creates a new file.",
         {"type": "object", "properties": {
             "file_path": {"type": "string"},
             "old_string": {"type": "string", "allow_empty": True},
             "new_string": {"type": "string", "allow_empty": True},
             "replace_all": {"type": "boolean"}},
          "required": ["file_path", "old_string", "new_string"]}, search_replace,
         lambda a: Access(writes=(a.get("file_path"),))),
]
