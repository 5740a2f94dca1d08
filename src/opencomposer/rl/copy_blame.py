"""Copy blame (`ObjectiveConfig.copy_blame`): the token where a failed edit's `old_string` left the file.

Why: in the renames family an edit's `old_string` is copied from what grep or read_file showed,
and an edit that matches nothing (`NoMatch`) is a copy that went wrong at one place: a space of
indentation too many, a closing quote dropped, an invented identifier (docs/rl.md). Getting that
right is the same skill in every task, and it is the one skill RL has carried to held-out tasks
here (`NoMatch` fell 44 -> 14 and 44 -> 9 over the held-out episodes in two runs). But the outcome
reward gives every token of a rollout one advantage, and the per-call term
(`call_advantage`) blames every token of a failed call alike, the JSON around the copy included:
in the run that had it, broken calls rose while `NoMatch` fell. The tool knows where the copy went
wrong: the longest prefix of `old_string` that occurs in the file (`harness/tools/files.py`,
`matched_prefix`, recorded in the trajectory's `detail`). This finds the sampled token that wrote
the first character past it, and the trainer gives that one token a negative advantage of its own.

Tokens are the contract: the position comes from the sampled ids, decoded, never from re-encoded
text. A call whose `old_string` cannot be found in its completion's decoded text exactly as the
tool received it (a lenient parse, a truncated completion) gets no blame.
"""

from __future__ import annotations

import json
from typing import Any

from opencomposer.rl.rewards import _get

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"'}


def copy_errors(traj) -> dict[tuple[int, int], list[list]]:
    """(segment, completion) -> [[nth, old_string, matched], ...] for each `search_replace` call of
    that completion that matched nothing and recorded where its copy left the file; nth counts the
    completion's calls whose arguments carry an `old_string`, in order (the occurrences of the key
    in the sampled text). Matched to the executed calls by tool-call id, as `rewards.completion_calls`."""
    records = {(_get(t, "segment", 0), _get(t, "id")): t for t in _get(traj, "tool_calls", []) or []}
    out: dict[tuple[int, int], list[list]] = {}
    for si, seg in enumerate(_get(traj, "segments", []) or []):
        for ci, comp in enumerate(_get(seg, "completions", []) or []):
            nth = 0
            for tc in _get(comp, "tool_calls", []) or []:
                try:
                    args = json.loads(_get(tc, "arguments") or "")
                except (json.JSONDecodeError, TypeError):
                    continue
                if not isinstance(args, dict) or not isinstance(args.get("old_string"), str):
                    continue
                rec = records.get((si, _get(tc, "id")))
                detail = _get(rec, "detail") if rec is not None else None
                if rec is not None and _get(rec, "error_type") == "NoMatch" and isinstance(detail, dict) \
                        and isinstance(detail.get("matched"), int):
                    out.setdefault((si, ci), []).append([nth, args["old_string"], detail["matched"]])
                nth += 1
    return out


def _json_string(text: str, i: int) -> tuple[str, list[int]] | None:
    """The JSON string whose body starts at text[i] (after its opening quote): its value and, per
    character of the value, the offset in `text` where it was written; None if it does not close."""
    chars: list[str] = []
    where: list[int] = []
    while i < len(text):
        c = text[i]
        if c == '"':
            return "".join(chars), where
        if c != "\\":
            chars.append(c)
            where.append(i)
            i += 1
            continue
        e = text[i + 1:i + 2]
        if e == "u":
            try:
                code = int(text[i + 2:i + 6], 16)
            except ValueError:
                return None
            step = 6
            if 0xD800 <= code < 0xDC00 and text[i + 6:i + 8] == "\\u":  # a surrogate pair: one character
                try:
                    low = int(text[i + 8:i + 12], 16)
                except ValueError:
                    return None
                if 0xDC00 <= low < 0xE000:
                    code, step = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00), 12
            chars.append(chr(code))
        elif e in _ESCAPES:
            chars.append(_ESCAPES[e])
            step = 2
        else:
            return None
        where.append(i)
        i += step
    return None


def _old_string_values(text: str) -> list[tuple[str, list[int]]]:
    """Every `"old_string": "..."` value written in `text`, in order (a key escaped inside another
    string, `\\"old_string\\"`, is not one)."""
    out, start = [], 0
    key = '"old_string"'
    while (k := text.find(key, start)) >= 0:
        start = k + len(key)
        if k > 0 and text[k - 1] == "\\":
            continue
        j = start
        while j < len(text) and text[j] in " \t\n\r":
            j += 1
        if text[j:j + 1] != ":":
            continue
        j += 1
        while j < len(text) and text[j] in " \t\n\r":
            j += 1
        if text[j:j + 1] != '"':
            continue
        value = _json_string(text, j + 1)
        if value is not None:
            out.append(value)
    return out


def blame_token(tokenizer: Any, ids: list[int], nth: int, old: str, matched: int) -> int | None:
    """The index in `ids` (one completion's sampled ids) of the token that wrote character `matched`
    of the nth `old_string` value, or None where the value is not `old` as the tool received it or
    `matched` is not inside it."""
    if not 0 <= matched < len(old):
        return None
    text = tokenizer.decode(ids)
    values = _old_string_values(text)
    if nth >= len(values) or values[nth][0] != old:
        return None
    at = values[nth][1][matched]
    # the first token whose decoded prefix reaches past `at`; decoded length grows with the prefix
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid + 1])) > at:
            hi = mid
        else:
            lo = mid + 1
    return lo


def token_copy_blame(seq, tokenizer: Any, coef: float) -> tuple[list[float], int] | None:
    """Per trained token of `seq`: -coef on each token that wrote where a copy left the file, 0
    elsewhere, and how many tokens got it; None when none does (or the record does not say which
    tokens are whose)."""
    errors = getattr(seq, "copy_errors", None) or []
    if not coef or not errors or sum(seq.completion_tokens) != seq.trained_tokens:
        return None
    trained = [t for t, m in zip(seq.ids, seq.loss_mask) if m]
    offsets, at = {}, 0
    for ci, n in zip(seq.completions, seq.completion_tokens):
        offsets[ci] = (at, n)
        at += n
    out = [0.0] * len(trained)
    hits = 0
    for ci, nth, old, matched in errors:
        if ci not in offsets:
            continue
        start, n = offsets[ci]
        t = blame_token(tokenizer, trained[start:start + n], nth, old, matched)
        if t is not None and out[start + t] == 0.0:
            out[start + t] = -coef
            hits += 1
    return (out, hits) if hits else None
