"""The speedrun's recipes and how a second invocation finds the run to continue."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from opencomposer.core.config import load_config
from opencomposer.speedrun import CHECKS, RECIPE, SpeedrunConfig, finished_stages, open_run, preset_file, recipe_key

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("speedrun-*.toml")), ids=lambda p: p.stem)
def test_every_preset_loads(path):
    cfg = load_config(SpeedrunConfig, path)
    assert cfg.preset == path.stem.removeprefix("speedrun-")
    assert set(cfg.stages) <= set(CHECKS + RECIPE)
    assert preset_file(cfg.preset) == path


def test_unknown_preset_names_the_ones_there_are():
    with pytest.raises(Exception, match="presets: .*smoke"):
        preset_file("no-such")


def write_events(root: Path, *events: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_a_second_invocation_continues_the_unfinished_run_of_the_same_recipe(tmp_path):
    cfg = SpeedrunConfig(out_dir=tmp_path, name="speedrun")
    other = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, steps=99))
    killed, failed, clean, foreign = (tmp_path / f"2026120{i}-000000-speedrun" for i in range(1, 5))
    write_events(killed, {"event": "stage_start", "stage": "sandbox"}, {"event": "stage_end", "stage": "sandbox",
                                                                           "seconds": 1.0},
                 {"event": "stage_start", "stage": "harness"})
    write_events(failed, {"event": "stage_failed", "stage": "harness"},
                 {"event": "speedrun_end", "failed": ["harness"]})
    write_events(clean, {"event": "speedrun_end", "failed": []})
    write_events(foreign, {"event": "stage_start", "stage": "sandbox"})
    for root, c in ((killed, cfg), (failed, cfg), (clean, cfg), (foreign, other)):
        (root / "recipe.json").write_text(recipe_key(c))
    # the newest run of this recipe that did not finish cleanly: `failed` (a failed stage is retried)
    assert open_run(cfg) == (type(open_run(cfg)[0])(failed), True)
    (failed / "events.jsonl").write_text((failed / "events.jsonl").read_text()
                                         + json.dumps({"event": "speedrun_end", "failed": []}) + "\n")
    run, resumed = open_run(cfg)
    assert resumed and run.root == killed and finished_stages(run) == {"sandbox"}
    run, resumed = open_run(dataclasses.replace(cfg, fresh=True))
    assert not resumed and run.root not in (killed, failed, clean, foreign)
    # where it runs is not part of the recipe
    assert recipe_key(dataclasses.replace(cfg, out_dir=Path("/elsewhere"))) == recipe_key(cfg)
    assert recipe_key(other) != recipe_key(cfg)


def test_a_torn_last_line_does_not_swallow_the_next_record(tmp_path):
    from opencomposer.core.metrics import EventLog, read_jsonl

    p = tmp_path / "events.jsonl"
    p.write_text('{"event": "stage_end", "stage": "a", "seconds": 1}\n{"event": "stage_st')
    with EventLog(p) as log:
        log.emit("stage_start", stage="b")
    assert [e["stage"] for e in read_jsonl(p)] == ["a", "b"]
