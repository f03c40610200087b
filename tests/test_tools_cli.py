"""The command-line tools as a user meets them: a malformed or nonsensical option ends in one
line naming it and exit status 2 (parsers run in-process, nothing is computed), every option has
help, usage names the ``python -m`` command, a missing extra names its install command, long
phases show a progress line, and the demo states the plan's work against the planner's bound."""

import io
import runpy
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as tj
from tessera_jax.tools import cli, demo, finetune, profiler

TOOLS = {"demo": demo, "finetune": finetune, "profiler": profiler}
PARSERS = {name: (lambda a, m=m: m.parser().parse_args(a)) for name, m in TOOLS.items()}

BAD = [
    ("demo", ["--cpu-grid", "4,16"], "--cpu-grid"),
    ("demo", ["--cpu-grid", "4,x,16"], "--cpu-grid"),
    ("demo", ["--cpu-grid", "0,16,16"], "--cpu-grid"),
    ("demo", ["--repeats", "0"], "--repeats"),
    ("demo", ["--repeats", "-2"], "--repeats"),
    ("demo", ["--repeats", "2.5"], "--repeats"),
    ("finetune", ["--latent", "3,8"], "--latent"),
    ("finetune", ["--latent", "3,-8,8"], "--latent"),
    ("finetune", ["--steps", "0"], "--steps"),
    ("finetune", ["--lr", "0"], "--lr"),
    ("finetune", ["--lr", "nan"], "--lr"),
    ("finetune", ["--layers", "0"], "--layers"),
    ("finetune", ["--heads", "-1"], "--heads"),
    ("finetune", ["--head-dim", "x"], "--head-dim"),
    ("finetune", ["--block", "0"], "--block"),
    ("finetune", ["--keep", "0"], "--keep"),
    ("finetune", ["--keep", "1.5"], "--keep"),
    ("finetune", ["--mask", "dense"], "--mask"),
    ("profiler", ["--heads", "-1"], "--heads"),
    ("profiler", ["--max-masks", "0"], "--max-masks"),
    ("profiler", ["--time-budget", "-5"], "--time-budget"),
    ("profiler", ["--max-error-streak", "0"], "--max-error-streak"),
    ("profiler", ["--policies", "bogus"], "--policies"),
    ("profiler", ["--candidates", "xla_64x64"], "--candidates"),
    ("profiler", ["--candidates", "xla_64x64/bogus"], "--candidates"),
    ("profiler", ["--dtype", "int8"], "--dtype"),
    ("profiler", ["--candidates", "nosuch_q64/merge"], "--candidates"),
    ("profiler", ["--templates", "nosuch_q64"], "--templates"),
    ("profiler", ["--backends", "cuda"], "--backends"),
    ("profiler", ["--families", "nosuch"], "--families"),
    ("profiler", ["--head-dim", "0"], "--head-dim"),
    ("profiler", ["--warmup", "-1"], "--warmup"),
    ("profiler", ["--iters", "0"], "--iters"),
]


@pytest.mark.parametrize("tool,argv,option", BAD, ids=[f"{t}{' '.join(a)}" for t, a, _ in BAD])
def test_malformed_option_is_one_line_exit_2(tool, argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[tool](argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"python -m tessera_jax.tools.{tool}: error: argument {option}"), err
    assert argv[-1].split("/")[0] in err          # the value the user typed


def test_finetune_latent_must_fit_the_patch(capsys):
    with pytest.raises(SystemExit) as e:
        finetune.main(["--latent", "3,7,8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --latent" in err and "(1, 2, 2)" in err


def test_good_options_parse_to_typed_values():
    a = demo.parser().parse_args(["--cpu-grid", "2,8,16", "--repeats", "3"])
    assert a.cpu_grid == (2, 8, 16) and a.repeats == 3
    a = finetune.parser().parse_args(["--latent", "5,16,16", "--keep", "1", "--steps", "1"])
    assert a.latent == (5, 16, 16) and a.keep == 1.0 and a.steps == 1
    assert demo.parser().parse_args([]).cpu_grid == (4, 16, 16)
    assert finetune.parser().parse_args([]).latent == (3, 8, 8)
    a = profiler.parse_args(["--heads", "0", "--warmup", "0", "--candidates", "xla_64x64/merge",
                             "--templates", "xla_64x64", "--families", "sta", "vsa"])
    assert a.heads == 0 and a.warmup == 0 and a.candidates == ["xla_64x64/merge"]
    assert a.templates == ["xla_64x64"] and a.families == ["sta", "vsa"]


@pytest.mark.parametrize("tool", ["demo", "finetune", "profiler"])
def test_help_names_the_command_and_every_option(tool, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[tool](["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m tessera_jax.tools.{tool} ")
    for act in TOOLS[tool].parser()._actions:
        assert act.help and act.help.strip(), act.option_strings


def test_finetune_without_flax_names_the_extra_even_for_help(monkeypatch, capsys):
    """A wheel without the flax extra: ``finetune --help`` and any run end in one clear line
    with the install command, not ModuleNotFoundError."""
    for name in list(sys.modules):
        if (name.split(".")[0] in ("flax", "optax") or name == "tessera_jax.flax"
                or name.startswith("tessera_jax.models") or name == "tessera_jax.tools.finetune"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flax", None)
    monkeypatch.setitem(sys.modules, "optax", None)
    for argv in (["--help"], ["--steps", "2"]):
        monkeypatch.setattr(sys, "argv", ["finetune"] + argv)
        with pytest.raises(SystemExit) as e:
            runpy.run_module("tessera_jax.tools.finetune", run_name="__main__")
        msg = str(e.value.code)
        assert e.value.code != 0 and "\n" not in msg
        assert msg.startswith("python -m tessera_jax.tools.finetune: error:")
        assert "pip install 'tessera_jax[flax]'" in msg and "flax" in msg
    assert "usage" not in capsys.readouterr().out


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_ticks_while_nothing_advances_it(monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    with cli.ticking("compiling the step", every=0.05):
        time.sleep(0.6)                         # a silent call, e.g. a compile
    text = tty.getvalue()
    assert "compiling the step" in text
    assert text.count("\r") >= 5                # redrawn while the call ran, not once


def test_progress_line_counts_steps_and_stays_off_logs(monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    with cli.ticking("training", total=3, unit="step") as bar:
        for _ in range(3):
            time.sleep(0.25)                    # past tqdm's redraw interval
            bar.update(1)
    assert "3/3" in tty.getvalue()
    log = io.StringIO()                         # redirected stderr: no control characters
    monkeypatch.setattr(sys, "stderr", log)
    with cli.ticking("compiling", every=0.01) as bar:
        time.sleep(0.05)
        bar.update(1)
    assert log.getvalue() == ""


@pytest.mark.parametrize("grid", [(3, 5, 7), (2, 8, 16)])
def test_demo_states_work_against_the_planners_bound(grid):
    """``Plan.stats()``'s contract: no head computes more than a dense plan of the same tiles
    (``dense_tile_interactions``), which exceeds Lq x Lkv where the tiles overhang; the demo's
    line says which of the two it compares with."""
    from tessera_jax import masks

    g = masks.Grid("demo", *grid, 4)
    mask = masks.sta(g, heads=4, tile=(2, 4, 4), window=(1, 3, 3))
    shape = (1, g.video_tokens, 4, 64)
    plan = tj.plan(mask, shape, shape, jnp.float32)
    s = plan.stats()
    assert s["computed_interactions"] <= s["dense_tile_interactions"]
    line = demo._work_line(plan)
    ratio = s["computed_interactions"] / s["dense_tile_interactions"]
    assert f"= {ratio:.2f}x a dense plan of the same {plan.tile_q}x{plan.tile_kv} tiles" in line
    overhang = s["dense_tile_interactions"] > s["dense_interactions"]
    assert ("Lq x Lkv" in line) == overhang
    if overhang:        # 105 tokens in 64-token tiles: the whole tile grid, 1.49x Lq x Lkv
        want = s["computed_interactions"] / s["dense_interactions"]
        assert f"{want:.2f}x Lq x Lkv x heads" in line and np.isclose(want, 16384 * 4 / 44100)


@pytest.mark.slow
def test_finetune_shows_progress_while_the_first_step_compiles(monkeypatch, capsys):
    """``finetune`` on a terminal: the progress line is redrawn while the first step compiles
    (seconds with nothing else printed), then counts the steps; the loss summary follows."""
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    finetune.main(["--steps", "2", "--layers", "1"])
    bar = tty.getvalue()
    compiling = bar.count("compiling the training step")
    assert compiling >= 2, bar                      # redrawn during the compile, not once
    assert "training" in bar and "2/2" in bar
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step   0  loss") and out[-1].startswith("loss: first 1 steps")
