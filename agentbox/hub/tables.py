"""Rich renderings of a plan and of the local models, for `agentbox plan` and `agentbox models`."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from agentbox.hub.plan import Plan, describe_machine, engine_runs
from agentbox.hub.profiles import Profile
from agentbox.hub.pull import LocalModel
from agentbox.hw.probe import GIB


def render_plan(p: Plan) -> Group:
    prof = p.profile
    kv_tok = p.to_dict()["kv_bytes_per_token"]
    head = Text.from_markup(
        f"[bold]{prof.name}[/] ({prof.architecture}, {prof.params / 1e9:.1f}B params"
        f"{', MoE' if prof.moe else ''}) on {describe_machine(p.probe)}\n"
        f"context {p.context:,} tokens x {p.sessions} session(s); KV {kv_tok / 1024:.0f} KiB/token "
        f"= 2 x {prof.layers} layers x {prof.kv_heads} kv heads x {prof.head_dim} head dim x "
        f"{2 if p.probe.gpus else 4} bytes"
    )
    table = Table(show_lines=False)
    for col in ("", "variant", "format", "download", "tp", "memory per device", "verdict"):
        table.add_column(col, overflow="fold")
    chosen = p.chosen
    for c in p.candidates:
        mark = "[green]>[/]" if c is chosen else ("[green]ok[/]" if c.ok else "[red]x[/]")
        verdict = "chosen" if c is chosen else ("runs" if c.ok else "\n".join(c.reasons))
        if c.notes:
            verdict += "\n[dim]" + "\n".join(c.notes) + "[/]"
        table.add_row(
            mark,
            c.variant.name,
            c.variant.format,
            f"{c.variant.size / GIB:.1f} GiB",
            str(c.tp),
            c.arithmetic,
            verdict,
        )
    parts: list[Text | Table] = [head, table]
    for note in p.notes:
        parts.append(Text(f"note: {note}", style="yellow"))
    if chosen is not None:
        parts.append(
            Text.from_markup(
                f"[bold green]plan:[/] {prof.name}:{chosen.variant.name} at tp={chosen.tp}  "
                f"(agentbox pull {prof.name}:{chosen.variant.name})"
            )
        )
    else:
        parts.append(Text.from_markup("[bold red]no variant runs on this machine[/] — see the reasons above"))
    return Group(*parts)


def render_profiles(profiles: list[Profile]) -> Table:
    table = Table(title="known models")
    for col in ("model", "architecture", "params", "variants", "engine"):
        table.add_column(col)
    for prof in sorted(profiles, key=lambda p: p.name.lower()):
        table.add_row(
            prof.name,
            prof.architecture,
            f"{prof.params / 1e9:.1f}B",
            ", ".join(v.name for v in prof.variants),
            "[green]runs[/]" if engine_runs(prof) else "[yellow]not yet[/]",
        )
    return table


def render_models(models: list[LocalModel]) -> Table:
    table = Table(title="local models")
    for col in ("model", "variant", "size", "state", "path"):
        table.add_column(col, overflow="fold")
    for m in models:
        state = "embedded" if m.embedded else ("complete" if m.complete else "[yellow]partial[/]")
        table.add_row(m.model, m.variant, f"{m.size / GIB:.2f} GiB", state, str(m.path))
    return table


def print_plan(p: Plan, console: Console | None = None) -> None:
    (console or Console()).print(render_plan(p))
