"""Output that fits the terminal: help, plan and model lists at 80 columns show every name whole, and output
into a pipe is not wrapped (a path or a command split over two lines cannot be pasted)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agentbox.cli.main import app
from agentbox.hub.embedded import embedded_model_path

HW = Path(__file__).resolve().parents[1] / "profiles" / "hardware"
MOE = ["plan", "Qwen3-Coder-30B-A3B-Instruct", "--hardware", str(HW / "2x-rtx5090.json")]
AT_80 = {"COLUMNS": "80"}
PIPE = {"COLUMNS": None}  # CliRunner's output is no terminal: as `agentbox ... | less`


def _run(args: list[str], env: dict[str, str | None]) -> str:
    out = CliRunner().invoke(app, args, env=env)
    assert out.exit_code in (0, 2), out.output  # plan exits 2 when nothing runs
    return out.output


def _commands() -> list[tuple[list[str], typer.core.TyperCommand]]:
    """Every command of the CLI with the words that reach it."""
    root = typer.main.get_command(app)
    found: list[tuple[list[str], typer.core.TyperCommand]] = []

    def walk(cmd: typer.core.TyperCommand, path: list[str]) -> None:
        found.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():  # a group (typer's own, not click.Group)
            walk(sub, [*path, name])

    walk(root, [])
    return found


@pytest.mark.parametrize(("path", "cmd"), _commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_help_at_80_columns_shows_every_name_whole(path: list[str], cmd: typer.core.TyperCommand) -> None:
    text = _run([*path, "--help"], AT_80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "…" not in text and "..." not in text.replace("[ARGS]...", "").replace("{URL}...", "")  # nothing cut short
    for param in cmd.params:
        for opt in param.opts:
            assert opt in text, f"{opt} missing from `agentbox {' '.join(path)} --help`"
    for name in getattr(cmd, "commands", {}):
        assert f"  {name} " in text
    if path == ["serve"]:
        assert len(lines) < 62, len(lines)  # was 104 lines of boxes at 80 columns (59 before --cpu-moe, --n-cpu-moe)


def test_plan_at_80_columns_wraps_its_explanations_under_the_rows() -> None:
    text = _run(MOE, AT_80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    rows = [line for line in lines if line.startswith((" >  ", " ok ", " x  "))]
    # bf16 fits two cards with the experts of 2 of its 48 MoE layers in host RAM (hub/offload.py), ranked after
    # the others: no CPU expert kernel runs bf16 experts yet; nvfp4 runs (W4A16 on cards without FP4 cores)
    assert [r.split()[1] for r in rows] == ["fp8", "q4_k_m", "nvfp4", "awq", "bf16"]
    assert rows[0].rstrip().endswith("chosen")
    # the memory arithmetic and every reason are still there, wrapped at spaces, nothing cut
    joined = " ".join(line.strip() for line in lines)
    assert "29.9/2 weights + 3.0/2 KV + 2.3 reserve = 18.7 GiB <= 31.3 GiB free per GPU" in joined
    assert "experts of 2 of 48 MoE layers in RAM" in joined and "(--n-cpu-moe 2)" in joined
    assert "above the 8 tok/s floor" in joined and "no CPU expert kernel for them yet" in joined
    assert "(agentbox pull Qwen3-Coder-30B-A3B-Instruct:fp8)" in joined


def test_plan_into_a_pipe_keeps_each_row_and_note_on_one_line() -> None:
    lines = _run(MOE, PIPE).splitlines()
    chosen = next(line for line in lines if line.startswith(" >  "))
    assert "fp8" in chosen and "= 18.7 GiB <= 31.3 GiB free per GPU" in chosen and chosen.rstrip().endswith("chosen")
    assert any(len(line) > 120 and "known bad on sm_120" in line for line in lines)  # a long note, whole


def test_plan_in_a_real_80_column_terminal() -> None:
    """No $COLUMNS: the width comes from the terminal itself (a pty of 80x24)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "agentbox.cli.main", *MOE], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))
    lines = [line.rstrip("\r") for line in text.split("\n")]
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert any(line.startswith(" >  fp8") for line in lines)


def test_known_models_at_80_columns_never_cut_a_name() -> None:
    from agentbox.hub.profiles import load_profiles

    text = _run(["models", "--known"], AT_80)
    assert all(len(line) <= 80 for line in text.splitlines())
    for prof in load_profiles():
        assert f" {prof.name} " in text, prof.name  # whole, as `agentbox plan NAME` takes it


@pytest.mark.parametrize("env", [AT_80, PIPE], ids=["80-columns", "pipe"])
def test_local_models_print_whole_paths(env: dict[str, str | None]) -> None:
    path = embedded_model_path()
    if path is None:
        pytest.skip("the embedded SmolLM2 is not installed")
    lines = _run(["models"], env).splitlines()
    assert "SmolLM2-135M-Instruct:embedded" in lines[1]  # the name `serve --model` and `pull` take
    assert any(line.strip() == str(path) for line in lines), lines  # on one line, however long
