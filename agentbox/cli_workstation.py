"""The workstation commands: plan / pull / models / doctor (hw + hub) and setup / launch / check (clients).
cli.py merges `workstation_app` into the root command and adds `check_app` as `agentbox check`."""

from __future__ import annotations

from pathlib import Path

import typer

from agentbox.cli_common import fail
from agentbox.hub.plan import PlanConfig  # the planner's defaults; no torch at import

# Nameless: cli.py merges these commands into `agentbox` itself, so they stay `agentbox plan`, not a group.
workstation_app = typer.Typer()

# ---- workstation: plan / pull / models / doctor (hw + hub) ----

_P = PlanConfig()


@workstation_app.command("plan")
def plan_cmd(
    model: str | None = typer.Argument(None, help="a model name (see `agentbox models --known`); default: the serve default"),  # noqa: UP007
    hardware: Path | None = typer.Option(None, "--hardware", help="plan for a machine described in JSON (profiles/hardware/)"),  # noqa: UP007
    context: int | None = typer.Option(None, "--context", help="tokens per session (default: min(32768, the model's))"),  # noqa: UP007
    sessions: int = typer.Option(_P.sessions, "--sessions", help="sessions whose KV stays resident"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Which variant of a model runs on this machine (or a described one), with the memory arithmetic."""
    import json
    from dataclasses import replace

    from rich.console import Console

    from agentbox.hub.chain import default_profiles
    from agentbox.hub.plan import plan
    from agentbox.hub.profiles import ProfileError, find_profile
    from agentbox.hub.tables import render_plan
    from agentbox.hw.probe import Probe, probe

    try:
        profiles = [find_profile(model)] if model else default_profiles()
    except ProfileError as exc:
        fail(str(exc))
    if not profiles:
        fail("no model given and no profile has a default_rank")
    machine = Probe.load(hardware) if hardware else probe()
    cfg = replace(_P, context=context, sessions=sessions)
    plans = [plan(prof, machine, cfg) for prof in profiles]  # no MODEL: the first default that runs here
    result = next((p for p in plans if p.chosen is not None), plans[0])
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        Console(width=max(Console().width, 160)).print(render_plan(result))
    if result.chosen is None:
        raise typer.Exit(2)


@workstation_app.command("pull")
def pull_cmd(
    spec: str = typer.Argument(..., help="MODEL or MODEL:VARIANT; without a variant, the planner picks for this machine"),
    hardware: Path | None = typer.Option(None, "--hardware", help="pick the variant for a described machine"),  # noqa: UP007
    revision: str = typer.Option("main", help="branch, tag or commit on the hub"),
) -> None:
    """Download one variant's files (resumable, progress bars, disk checked first). HF_TOKEN for gated repos."""
    from agentbox.hub.plan import plan
    from agentbox.hub.profiles import ProfileError
    from agentbox.hub.pull import PullError, parse_spec, pull
    from agentbox.hw.probe import Probe, probe

    try:
        profile, variant = parse_spec(spec)
    except ProfileError as exc:
        fail(str(exc))
    if variant is None:
        chosen = plan(profile, Probe.load(hardware) if hardware else probe(try_kernels=False)).chosen
        if chosen is None:
            fail(f"no variant of {profile.name} runs on this machine (see `agentbox plan {profile.name}`); "
                  f"name one to pull it anyway: agentbox pull {profile.name}:VARIANT")
        variant = chosen.variant
    try:
        path = pull(profile, variant, revision=revision)
    except PullError as exc:
        fail(str(exc))
    typer.echo(f"{profile.name}:{variant.name} is at {path}")


@workstation_app.command("models")
def models_cmd(
    known: bool = typer.Option(False, "--known", help="list the models agentbox has profiles for"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """List the models on this machine, with sizes (or, with --known, every profiled model)."""
    import json

    from rich.console import Console

    from agentbox.hub.profiles import load_profiles
    from agentbox.hub.pull import list_local
    from agentbox.hub.tables import render_models, render_profiles

    if known:
        Console().print(render_profiles(load_profiles()))
        return
    local = list_local()
    if json_out:
        typer.echo(json.dumps([{**m.__dict__, "path": str(m.path)} for m in local], indent=2))
        return
    Console().print(render_models(local))


@workstation_app.command("doctor")
def doctor_cmd(
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
    model: str | None = typer.Option(None, "--model", help="plan this model instead of the default"),  # noqa: UP007
    urls: list[str] | None = typer.Option(None, "--url", help="check these servers or a fleet's router (and its backends) instead of this machine"),  # noqa: UP007
    api_key: str | None = typer.Option(None, envvar="AGENTBOX_API_KEY", help="with --url: the servers' API key"),  # noqa: UP007
) -> None:
    """Check this machine: GPUs, drivers, wheels, models, disk, the port and a running server — with fixes."""
    import json

    if urls:
        from agentbox.cli_fleet import doctor_urls

        doctor_urls(urls, json_out, api_key)
        return

    from rich.console import Console

    from agentbox.hw.doctor import doctor, render

    report = doctor(model=model)
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        render(report, Console())
    if not report.ok:
        raise typer.Exit(1)


# ---- clients: setup / launch / check (clients + chat) ----


@workstation_app.command("setup")
def setup_cmd(
    client: str = typer.Argument(..., help="claude-code | codex | opencode | aider | env"),
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server, else http://127.0.0.1:8000)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="model name (default: the running server's)"),  # noqa: UP007
    context: int | None = typer.Option(None, "--context", help="context window told to the client (default: the server's)"),  # noqa: UP007
    api_key: str | None = typer.Option(None, "--api-key", envvar="AGENTBOX_API_KEY", help="the server's API key (default: the running server's)"),  # noqa: UP007
    dry_run: bool = typer.Option(False, "--dry-run", help="print the change as a diff, write nothing"),
    undo: bool = typer.Option(False, "--undo", help="restore the config file from the latest backup"),
) -> None:
    """Point a coding client at the local server (merges into its config, backs it up first)."""
    from agentbox.clients import SETUP_CLIENTS, ClientError, resolve_endpoint, setup_client

    if client not in SETUP_CLIENTS:
        fail(f"unknown client {client!r}; choose from {', '.join(SETUP_CLIENTS)}")
    try:
        endpoint = resolve_endpoint(url, model, api_key, context=context, require_model=not undo)
        lines = setup_client(client, endpoint, dry_run=dry_run, undo=undo)
    except ClientError as exc:
        fail(str(exc))
    for line in lines:
        typer.echo(line)


@workstation_app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch_cmd(
    ctx: typer.Context,
    client: str = typer.Argument(..., help="claude | codex | opencode | aider (extra arguments go to the client)"),
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="model name (default: the running server's)"),  # noqa: UP007
    api_key: str | None = typer.Option(None, "--api-key", envvar="AGENTBOX_API_KEY", help="the server's API key (default: the running server's)"),  # noqa: UP007
    force: bool = typer.Option(False, "--force", help="launch even when the client's own prompt does not fit the context"),
) -> None:
    """Run a coding client with its environment pointed at the local server; writes no file."""
    from agentbox.clients import LAUNCH_CLIENTS, ClientError, launch_client, resolve_endpoint

    if client not in LAUNCH_CLIENTS:
        fail(f"unknown client {client!r}; choose from {', '.join(LAUNCH_CLIENTS)}")
    try:
        launch_client(client, resolve_endpoint(url, model, api_key), list(ctx.args), force=force)
    except ClientError as exc:
        fail(str(exc))


check_app = typer.Typer(help="Checks against a running server.", no_args_is_help=True)


@check_app.command("tools")
def check_tools_cmd(
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="model name (default: the server's)"),  # noqa: UP007
    api_key: str | None = typer.Option(None, "--api-key", envvar="AGENTBOX_API_KEY", help="the server's API key (default: the running server's)"),  # noqa: UP007
) -> None:
    """Prove tool calls round-trip: zero-argument calls, reasoning kept apart, parallel and multi-turn calls."""
    from rich.console import Console
    from rich.table import Table

    from agentbox.clients import ClientError, resolve_endpoint
    from agentbox.clients.check import run_checks

    try:
        ep = resolve_endpoint(url, model, api_key, require_model=False)
    except ClientError as exc:
        fail(str(exc))
    results = run_checks(ep.url, model or ep.model or None, ep.api_key)
    table = Table(title=f"tool checks against {ep.url}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for r in results:
        table.add_row(r.name, "[green]pass[/]" if r.ok else "[red]FAIL[/]", r.detail)
    Console().print(table)
    if not all(r.ok for r in results):
        raise typer.Exit(1)
