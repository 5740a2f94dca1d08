from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from opencomposer.core.config import ConfigError, load_config, parse_override, to_dict


@dataclass(frozen=True, kw_only=True, slots=True)
class Inner:
    lr: float = 1e-3
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    sizes: tuple[int, ...] = (1, 2)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outer:
    steps: int = 10
    out: Path = Path("runs")
    limit: int | None = None
    inner: Inner = field(default_factory=Inner)


def test_defaults_toml_and_overrides(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text('steps = 5\n[inner]\nname = "y"\nsizes = [3, 4]\n')
    cfg = load_config(Outer, p, ["--inner.lr=0.5", "--limit=7", "--inner.mode=b", "--out=/x"])
    assert cfg.steps == 5 and cfg.inner.name == "y" and cfg.inner.sizes == (3, 4)
    assert cfg.inner.lr == 0.5 and cfg.limit == 7 and cfg.inner.mode == "b" and cfg.out == Path("/x")
    with pytest.raises(AttributeError):
        cfg.steps = 1  # frozen


def test_unknown_keys_are_rejected_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) stpes; known: inner, limit, out, steps"):
        load_config(Outer, None, ["--stpes=3"])
    with pytest.raises(ConfigError, match="inner: unknown key"):
        load_config(Outer, None, ["--inner.nope=1"])


@pytest.mark.parametrize("ov,msg", [
    ("--steps=1.5", "expected an integer"),
    ("--steps=true", "expected an integer"),
    ("--inner.mode=c", "not one of"),
    ("--inner.sizes=[1, 'a']", "expected an integer"),
    ("--inner=3", "expected a table"),
])
def test_type_errors(ov, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(Outer, None, [ov])


def test_override_parsing():
    assert parse_override("--a.b=1") == ("a.b", 1)
    assert parse_override("--a=hello world") == ("a", "hello world")
    assert parse_override("--a=[1,2]") == ("a", [1, 2])
    with pytest.raises(ConfigError):
        parse_override("--a")
    with pytest.raises(ConfigError):
        parse_override("--a..b=1")


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Outer, tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(Outer, bad)


def test_to_dict_round_trip():
    cfg = load_config(Outer, None, ["--inner.lr=2"])
    d = to_dict(cfg)
    assert d["inner"]["lr"] == 2.0 and d["out"] == "runs"
    from opencomposer.core.config import from_dict

    assert from_dict(Outer, d) == cfg


def test_the_speedrun_rl_stage_offers_every_services_backend_of_the_loop():
    """`--rl.services=ray` reaches the loop: the stage's choices are the loop's, and an override
    of each loads."""
    import typing

    from opencomposer.rl.loop import RLConfig
    from opencomposer.rl.stage import RLStageConfig
    from opencomposer.speedrun import SpeedrunConfig

    def choices(cls):
        return typing.get_args(typing.get_type_hints(cls)["services"])

    assert choices(RLStageConfig) == choices(RLConfig)
    for name in choices(RLConfig):
        assert load_config(SpeedrunConfig, overrides=[f"rl.services={name}"]).rl.services == name
    with pytest.raises(ConfigError):
        load_config(SpeedrunConfig, overrides=["rl.services=slurm"])


def test_the_speedrun_rl_stage_hands_its_settings_to_the_loop():
    """What a preset or `--rl.x=` override says is what the loop runs with: learning rate, reward
    weights, the unsolved-group rule and the shared harness settings."""
    from pathlib import Path

    from opencomposer.rl.stage import loop_config
    from opencomposer.speedrun import SpeedrunConfig

    cfg = load_config(SpeedrunConfig, overrides=["rl.unsolved_groups=skip", "rl.lr=3e-5", "rl.failed_edit=0.05",
                                                 "rl.broken_call=0.02", "rl.group_size=6", "agent.turn_tokens=99",
                                                 "rl.negative_advantages=0.25", "rl.baseline=token_mean", "rl.bf16=auto",
                                                 "sft.bf16=auto", "rl.solved_groups=skip"])
    r = loop_config(cfg.rl, cfg.agent, Path("m"), Path("t"), "train", epochs=1)
    assert r.objective.unsolved_groups == "skip" and r.objective.group_size == 6
    assert r.objective.solved_groups == "skip"
    assert r.objective.negative_advantages == 0.25 and r.objective.baseline == "token_mean"
    assert r.trainer.lr == 3e-5 and r.rewards.failed_edit == 0.05 and r.rewards.broken_call == 0.02
    assert r.turn_tokens == 99 and r.evaluate is False
    assert r.trainer.bf16 == "auto" and cfg.sft.bf16 == "auto"
    assert loop_config(load_config(SpeedrunConfig).rl, cfg.agent, Path("m"), Path("t"), "train", 1) \
        .objective.unsolved_groups == "train"
    with pytest.raises(ConfigError):
        load_config(SpeedrunConfig, overrides=["rl.unsolved_groups=sometimes"])
    with pytest.raises(ConfigError):
        load_config(SpeedrunConfig, overrides=["sft.bf16=sometimes"])


def test_the_speedrun_rl_stage_trains_no_prompt_twice_unless_told():
    """The default preset's `steps = 48` over its 47 train tasks planned two epochs until
    2026-12-08, so one task came back; `epochs = 1` (the default) plans each task once (the
    loop stops when its plan is used up). `epochs = 0` is for a family smaller than `steps`."""
    from opencomposer.rl.loop import RLConfig, _plan
    from opencomposer.rl.stage import plan_epochs
    from opencomposer.speedrun import SpeedrunConfig

    cfg = load_config(SpeedrunConfig, path=Path(__file__).parents[2] / "configs" / "speedrun-default.toml").rl
    assert cfg.epochs == 1 and cfg.steps > 47 and plan_epochs(cfg, 47) == 1
    plan = _plan(47, RLConfig(model=Path("m"), tasks=Path("t"), epochs=plan_epochs(cfg, 47)))
    assert sorted(plan) == list(range(47))
    small = load_config(SpeedrunConfig, overrides=["rl.epochs=0", "rl.steps=48"]).rl
    assert plan_epochs(small, 47) == 2 and plan_epochs(small, 5) == 10


def test_the_trainer_and_a_replica_process_split_the_cores(monkeypatch):
    """With the replica in a process of its own the two compute at once: by default they split the
    CPUs this process may use; a replica in the driver or a Ray actor keeps torch's default, and
    explicit values win."""
    import os
    from pathlib import Path

    from opencomposer.rl.loop import RLConfig, thread_split

    base = RLConfig(model=Path("m"), tasks=Path("t"))
    for cpus, want in ((1, (1, 1)), (2, (1, 1)), (3, (1, 2)), (16, (8, 8))):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert thread_split(base) == want
    assert thread_split(RLConfig(model=Path("m"), tasks=Path("t"), services="threads")) == (0, 0)
    assert thread_split(RLConfig(model=Path("m"), tasks=Path("t"), services="ray", replica_threads=4)) == (0, 4)
    assert thread_split(RLConfig(model=Path("m"), tasks=Path("t"), trainer_threads=3)) == (3, 13)  # of 16
