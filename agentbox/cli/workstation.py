"""The workstation commands: owns plan / pull / models / doctor (hw + hub) and setup / launch / check
(clients). cli/main.py merges `workstation_app` into the root command and adds `check_app` as `agentbox check`."""

from __future__ import annotations

import typer

from agentbox.cli.common import fail
from agentbox.cli.console import console, output_width
from agentbox.config import PLAN_SESSIONS
from agentbox.hw.probe import GIB, Probe
from agentbox.invocation import agentbox_cmd

# Nameless: cli/main.py merges these commands into `agentbox` itself, so they stay `agentbox plan`, not a group.
workstation_app = typer.Typer()

# ---- workstation: plan / pull / models / doctor (hw + hub) ----


@workstation_app.command("plan")
def plan_cmd(
    model: str | None = typer.Argument(None, help="a model name (see `agentbox models --known`); default: the serve default"),  # noqa: UP007
    hardware: str | None = typer.Option(None, "--hardware", help="plan for another machine: a JSON file or a bundled name (2x-rtx5090)"),  # noqa: UP007
    context: int | None = typer.Option(None, "--context", help="tokens per session (default: min(32768, the model's))"),  # noqa: UP007
    sessions: int = typer.Option(PLAN_SESSIONS, "--sessions", help="sessions whose KV stays resident"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Which variant of a model fits this machine, with the arithmetic.

    Plans for this machine, or for one described in JSON (--hardware)."""
    import json

    described = _machine(hardware) if hardware else None  # a bad --hardware fails before torch loads
    from agentbox.hub.chain import default_profiles, first_servable, suggest_model
    from agentbox.hub.plan import PlanConfig, plan
    from agentbox.hub.profiles import ProfileError, find_profile
    from agentbox.hub.tables import render_plan
    from agentbox.hw.probe import probe

    machine = described or probe()
    cfg = PlanConfig(context=context, sessions=sessions)
    try:
        if model:
            profile = find_profile(model)
        else:  # the model agentbox suggests for agent work here: the one serve, doctor and the clients name
            found = suggest_model(machine, context or 0, PlanConfig(sessions=sessions))
            profile = find_profile(found.model) if found else next(iter(default_profiles()), None)
    except ProfileError as exc:
        fail(str(exc))
    if profile is None:
        fail("no model given and no profile has a default_rank")
    result = plan(profile, machine, cfg)
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        console().print(render_plan(result, output_width()))
        # What `serve` does here when it differs (a CPU box serves what it has, the embedded model): one story.
        starts = first_servable(machine) if not model and not described else None
        chosen = f"{profile.name}:{result.chosen.variant.name}" if result.chosen else None
        if starts is not None and not starts.startswith(f"{chosen} "):
            this = f"; this plan: {agentbox_cmd()} serve --model {profile.name}" if chosen else ""
            console().print(f"`agentbox serve` without --model starts with {starts}{this}", markup=False,
                            highlight=False)
    if result.chosen is None:
        raise typer.Exit(2)


def _machine(hardware: str) -> Probe:
    """--hardware: a file or a bundled name; a bad one is a one-line error naming the valid names."""
    from agentbox.hw.hardware import HardwareError, load_hardware

    try:
        return load_hardware(hardware)
    except HardwareError as exc:
        fail(str(exc))


@workstation_app.command("pull")
def pull_cmd(
    spec: str = typer.Argument(..., help="MODEL or MODEL:VARIANT; without a variant, the planner picks for this machine"),
    hardware: str | None = typer.Option(None, "--hardware", help="pick the variant for another machine: a JSON file or a bundled name"),  # noqa: UP007
    revision: str = typer.Option("main", help="branch, tag or commit on the hub"),
) -> None:
    """Download a model variant (resumable; disk space checked first).

    HF_TOKEN for gated repos."""
    described = _machine(hardware) if hardware else None  # a bad --hardware fails before torch loads
    from agentbox.hub.plan import plan
    from agentbox.hub.profiles import ProfileError
    from agentbox.hub.pull import PullError, parse_spec, pull
    from agentbox.hw.probe import probe

    try:
        profile, variant = parse_spec(spec)
    except ProfileError as exc:
        fail(str(exc))
    if variant is None:
        chosen = plan(profile, described or probe(try_kernels=False)).chosen
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
    rm: str | None = typer.Option(None, "--rm", metavar="NAME", help="delete a local model from disk: MODEL:VARIANT as listed (or MODEL: all its variants), complete or partial"),  # noqa: UP007
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """List the models on this machine (--known, --rm NAME).

    --known lists every profiled model; --rm NAME deletes a local one, complete or partial."""
    import json

    from agentbox.hub.profiles import load_profiles
    from agentbox.hub.pull import PullError, list_local, remove_local
    from agentbox.hub.tables import render_models, render_profiles

    if known:
        console().print(render_profiles(load_profiles()))
        return
    if rm is not None:
        _refuse_removing_the_served(rm)
        try:
            removed = remove_local(rm)
        except PullError as exc:
            fail(str(exc))
        for m in removed:
            typer.echo(f"removed {m.model}:{m.variant} ({m.size / GIB:.2f} GiB, {m.path})")
        return
    local = list_local()
    if json_out:
        typer.echo(json.dumps([{**m.__dict__, "path": str(m.path)} for m in local], indent=2))
        return
    console().print(render_models(local), crop=False)


def _refuse_removing_the_served(spec: str) -> None:
    """The running server's model files stay while it runs: deleting them under it would break its next load."""
    from pathlib import Path

    from agentbox.cli import daemon
    from agentbox.hub.pull import list_local

    st = daemon.read_state()
    if st is None or not st.get("model_path"):
        return
    served = Path(st["model_path"]).resolve()
    name, _, variant = spec.partition(":")
    for m in list_local():
        if m.model.lower() == name.lower() and variant.lower() in ("", m.variant.lower()):
            d = Path(m.path).resolve()
            if served == d or d in served.parents or served.parent == d.parent and d.is_file():
                fail(f"{m.model}:{m.variant} is what the running server serves (pid {st['pid']}); "
                     f"stop it first: {agentbox_cmd()} stop")


@workstation_app.command("doctor")
def doctor_cmd(
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
    model: str | None = typer.Option(None, "--model", help="plan this model instead of the default"),  # noqa: UP007
    urls: list[str] | None = typer.Option(None, "--url", help="check these servers or a fleet's router (and its backends) instead of this machine"),  # noqa: UP007
    api_key: str | None = typer.Option(None, envvar="AGENTBOX_API_KEY", help="with --url: the servers' API key"),  # noqa: UP007
) -> None:
    """Check this machine and say how to fix what is wrong.

    GPUs, drivers, wheels, models, disk, the port and a running server."""
    import json

    if urls:
        from agentbox.cli.fleet import doctor_urls

        doctor_urls(urls, json_out, api_key)
        return

    from agentbox.cli.doctor import doctor, render

    report = doctor(model=model)
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        render(report, console())
    if not report.ok:
        raise typer.Exit(1)


# ---- clients: setup / launch / check (clients + chat) ----


@workstation_app.command("setup")
def setup_cmd(
    client: str = typer.Argument(..., help="claude | codex | opencode | aider | env (long forms such as claude-code work too)"),
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server, else http://127.0.0.1:8000)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="model name (default: the running server's)"),  # noqa: UP007
    context: int | None = typer.Option(None, "--context", help="context window told to the client (default: the server's)"),  # noqa: UP007
    api_key: str | None = typer.Option(None, "--api-key", envvar="AGENTBOX_API_KEY", help="the server's API key (default: the running server's)"),  # noqa: UP007
    dry_run: bool = typer.Option(False, "--dry-run", help="print the change as a diff, write nothing"),
    undo: bool = typer.Option(False, "--undo", help="restore the config file from the latest backup"),
    force: bool = typer.Option(False, "--force", help="write it even when the client's own prompt does not fit the context"),
) -> None:
    """Point a coding client at the server (its config backed up first).

    Merges into the client's config file; --undo restores the backup."""
    from agentbox.clients import ClientError, parse_client, resolve_endpoint, setup_client

    try:
        parse_client(client)  # a typo fails before any server is asked
        endpoint = resolve_endpoint(url, model, api_key, context=context, require_model=not undo)
        lines = setup_client(client, endpoint, dry_run=dry_run, undo=undo, force=force)
    except ClientError as exc:
        fail(str(exc))
    for line in lines:
        typer.echo(line)


@workstation_app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch_cmd(
    ctx: typer.Context,
    client: str = typer.Argument(..., help="claude | codex | opencode | aider (long forms such as claude-code work too; extra arguments go to the client)"),
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="model name (default: the running server's)"),  # noqa: UP007
    api_key: str | None = typer.Option(None, "--api-key", envvar="AGENTBOX_API_KEY", help="the server's API key (default: the running server's)"),  # noqa: UP007
    force: bool = typer.Option(False, "--force", help="launch even when the client's own prompt does not fit the context"),
) -> None:
    """Run a coding client against the server; writes no file."""
    from agentbox.clients import ClientError, launch_client, parse_client, resolve_endpoint

    try:
        parse_client(client, with_env=False)
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
    """Prove tool calls round-trip against a running server.

    Zero-argument calls, reasoning kept apart, parallel and multi-turn calls."""
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
    console().print(table)
    if not all(r.ok for r in results):
        raise typer.Exit(1)
