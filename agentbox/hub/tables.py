"""Rich renderings of a plan and of the local models, for `agentbox plan` and `agentbox models`."""

from __future__ import annotations

import textwrap

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from agentbox.config import GPU_PAGE_SIZE
from agentbox.hub.engine_support import engine_runs
from agentbox.hub.plan import Plan, describe_machine
from agentbox.hub.profiles import Profile
from agentbox.hub.pull import LocalModel
from agentbox.hw.probe import GIB

# A plan row's explanation goes under it, indented past the mark, when the row would pass the width.
PLAN_INDENT = 4


def _wrapped(text: str, width: int | None, indent: int, style: str = "") -> list[Text]:
    """`text` as lines of at most `width` columns, each indented; words (paths, commands) are never split."""
    if width is None:
        return [Text(" " * indent + line, style=style) for line in text.splitlines()]
    # An item's continuation lines sit two columns further in, so where one reason ends is visible.
    return [Text(line, style=style)
            for para in text.splitlines()
            for line in textwrap.wrap(para, max(width, indent + 20), initial_indent=" " * indent,
                                      subsequent_indent=" " * (indent + 2), break_long_words=False,
                                      break_on_hyphens=False) or [""]]


def render_plan(p: Plan, width: int | None = None) -> Group:
    """The plan as lines that fit `width` columns (None: one line per row, however long, for a pipe). A row
    is mark, variant, download size, tp, then its memory arithmetic and verdict on the same line when they
    fit, else on the lines under it; reasons and notes always go under the row, wrapped at spaces."""
    prof = p.profile
    kv_tok = p.to_dict()["kv_bytes_per_token"]
    table = f" + a {prof.ngram_table_params / 1e9:.1f}B n-gram table in host RAM" if prof.ngram_table_params else ""
    lines = _wrapped(f"{prof.name} ({prof.architecture}, {prof.params / 1e9:.1f}B params{table}"
                     f"{', MoE' if prof.moe else ''})"
                     f" on {describe_machine(p.probe)}", width, 0)
    lines[0].stylize("bold", 0, len(prof.name))
    lines += _wrapped(
        f"context {p.context:,} tokens x {p.sessions} session(s); KV {kv_tok / 1024:.0f} KiB/token = "
        + _kv_formula(prof, 2 if p.probe.gpus else 4, p.with_mtp)
        + (f"; recurrent state {prof.state_bytes_per_session() / 2**20:.0f} MiB per session ("
           + ("live, page-aligned copy, 2 snapshots)" if prof.state_slots == 4 else "live ring, 1 snapshot)")
           if prof.state_bytes else ""), width, 0)
    chosen = p.chosen
    name_w = max((len(c.variant.name) for c in p.candidates), default=4)
    for c in p.candidates:
        mark, style = (">", "green") if c is chosen else ("ok", "green") if c.ok else ("x", "red")
        row = Text.assemble((f" {mark:<3}", style), f"{c.variant.name:<{name_w}} {c.variant.size / GIB:5.1f} GiB  tp {c.tp}  ")
        verdict = "chosen" if c is chosen else "runs"
        if c.ok:
            body, under = f"{c.arithmetic}   {verdict}", []
        else:  # the first reason on the row, the rest under it
            body, under = c.reasons[0], c.reasons[1:]
        if width is None or len(row) + len(body) <= width:
            lines.append(row + Text(body, style="" if c.ok else "red"))
        elif c.ok:  # the verdict stays on the row, where the eye looks for it
            lines.append(row + Text(verdict, style=style))
            lines += _wrapped(c.arithmetic, width, PLAN_INDENT)
        else:  # the reason starts on the row and wraps under it
            first, *rest = textwrap.wrap(body, width, initial_indent=" " * len(row),
                                         subsequent_indent=" " * (PLAN_INDENT + 2), break_long_words=False,
                                         break_on_hyphens=False)
            lines.append(row + Text(first[len(row):], style="red"))
            lines += [Text(line, style="red") for line in rest]
        for reason in under:
            lines += _wrapped(reason, width, PLAN_INDENT, "red")
        for note in c.notes:
            lines += _wrapped(note, width, PLAN_INDENT, "dim")
    for note in p.notes:
        lines += _wrapped(f"note: {note}", width, 0, "yellow")
    if chosen is not None:
        spec = f"{prof.name}:{chosen.variant.name}"
        split = f" with {chosen.split.serve_flag} (routed experts in host RAM)" if chosen.split else ""
        verdict = Text.assemble(("plan:", "bold green"), f" {spec} at tp={chosen.tp}{split}")
        pull = f"(agentbox pull {spec})"
        if width is None or len(verdict) + 2 + len(pull) <= width:
            lines.append(verdict + f"  {pull}")
        elif len(verdict) <= width:  # the command whole on its own line, never split
            lines += [verdict, Text(f"  {pull}")]
        else:  # the split's flag on a line of its own too: a line cut at the terminal's edge would hide it
            lines += [Text.assemble(("plan:", "bold green"), f" {spec} at tp={chosen.tp}"), Text(f"  {split.strip()}"),
                      Text(f"  {pull}")]
    else:
        lines.append(Text.assemble(("no variant runs on this machine", "bold red"), " — see the reasons above"))
    for line in lines:
        line.no_wrap = True  # already fitted: rich must not wrap it again
    return Group(*lines)


def render_profiles(profiles: list[Profile]) -> Table:
    """The names a user types (`agentbox plan NAME`, `serve --model NAME`) are never cut: at a narrow width
    the variants wrap (`agentbox plan NAME` shows the architecture)."""
    table = Table(title="known models", box=box.SIMPLE_HEAD, title_justify="left")
    rows = sorted(profiles, key=lambda p: p.name.lower())
    table.add_column("model", no_wrap=True, min_width=max((len(p.name) for p in rows), default=5))
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("engine", no_wrap=True)
    table.add_column("variants")
    for prof in rows:
        table.add_row(
            prof.name,
            f"{prof.params / 1e9:.1f}B",
            "[green]runs[/]" if engine_runs(prof) else "[yellow]not yet[/]",
            ", ".join(v.name for v in prof.variants),
        )
    return table


def render_models(models: list[LocalModel]) -> Group:
    """One line per model (MODEL:VARIANT, as `serve --model` and `pull` take it), its path on the next line,
    whole: a path cut by a table's column cannot be pasted."""
    lines: list[Text] = [Text("local models", style="bold")]
    if not models:
        lines.append(Text("none yet: agentbox pull MODEL (see agentbox models --known)"))
    for m in models:
        state = "embedded" if m.embedded else ("complete" if m.complete else "partial")
        spec = f"{m.model}:{m.variant}"
        lines.append(Text.assemble(spec, "  ", f"{m.size / GIB:.2f} GiB", "  ",
                                   (state, "" if m.complete or m.embedded else "yellow")))
        lines.append(Text(f"  {m.path}", style="dim"))
        if not m.complete:  # an interrupted pull: it continues where it stopped, or goes
            lines.append(Text(f"  resume: agentbox pull {spec}   remove: agentbox models --rm {spec}", style="yellow"))
    for line in lines:
        line.no_wrap, line.overflow = True, "ignore"  # the terminal wraps a long path; rich must not cut it
    return Group(*lines)


def _kv_formula(prof: Profile, dtype_bytes: int, mtp: bool = True) -> str:
    layers = f"{prof.kv_layers_ or prof.layers} {'attention ' if prof.kv_layers_ else ''}layers"
    if prof.mtp_layers and mtp:
        layers = f"({layers} + {prof.mtp_layers} MTP)"
    if prof.paged_groups:
        page = GPU_PAGE_SIZE  # plans place models on GPUs
        groups = " + ".join(f"{g.layers} layers x {g.values} / {min(g.tokens_per_entry, page)} tokens"
                            for g in prof.paged_groups)
        # Groups of one entry a token (GLM-5.3's latents and indexer keys, Qwen3.8-Flash-Next's K, V and indexer
        # key) are not compressed: only say so where a group pools tokens.
        what = (f"compressed entries (a slot per page of {page} at most)"
                if any(g.tokens_per_entry > 1 for g in prof.paged_groups) else "entries every token")
        return f"({groups}) x {dtype_bytes} bytes: {what}, the whole cache on every tensor-parallel rank"
    if prof.mla:
        return (f"{layers} x ({prof.kv_lora_rank} latent + {prof.qk_rope_head_dim} rope key) x {dtype_bytes} bytes, "
                f"the whole latent cache on every tensor-parallel rank")
    return f"2 x {layers} x {prof.kv_heads} kv heads x {prof.head_dim} head dim x {dtype_bytes} bytes"
