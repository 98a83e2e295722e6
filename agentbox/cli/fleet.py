"""`agentbox fleet URL URL ...`: owns the fleet commands, one base URL in front of several agentbox servers
(vllm-router, see agentbox/fleet.py), and `top` and `doctor` over a fleet. The fleet runs in the foreground:
stop it with Ctrl-C, or run it under systemd / nohup."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from agentbox.cli.common import fail
from agentbox.config import FleetConfig

fleet_app = typer.Typer()
_F = FleetConfig()


@fleet_app.command("fleet")
def fleet_cmd(
    backends: list[str] = typer.Argument(..., metavar="URL", help="agentbox server roots, e.g. http://10.0.0.2:8000 http://10.0.0.3:8000"),
    host: str = typer.Option(_F.host, help="address the router listens on (it checks no API key: keep it private)"),
    port: int = typer.Option(_F.port, help="port the router listens on"),
    api_key: str | None = typer.Option(None, envvar="AGENTBOX_API_KEY", help="the backends' API key, if they have one"),  # noqa: UP007
    log: Path | None = typer.Option(None, help="router log file (default: the state dir's fleet.log)"),  # noqa: UP007
) -> None:
    """Serve several agentbox servers at one URL (a router).

    Each session's turns stick to the server holding its cache."""
    from dataclasses import replace

    from agentbox import fleet
    from agentbox.config import state_dir

    urls = [fleet.root_url(u) for u in backends]
    cfg = replace(_F, host=host, port=port)
    try:
        found = fleet.check_backends(urls, api_key)
        proc = fleet.start(urls, cfg, api_key=api_key, log=log or state_dir() / "fleet.log")
    except fleet.FleetError as e:
        fail(str(e))
    base = fleet.router_url(cfg)
    typer.echo(f"fleet of {len(found)} agentbox servers ({found[0].model}) at {base}/v1 (vllm-router pid {proc.pid})")
    typer.echo(f"  clients:  agentbox setup codex --url {base}    (or: agentbox launch claude --url {base})")
    typer.echo(f"  watch:    agentbox top --url {base}            check: agentbox doctor --url {base}")
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        code = proc.wait()
    if code not in (0, -signal.SIGTERM, -signal.SIGINT):
        fail(f"vllm-router exited with status {code}; its log: {log or state_dir() / 'fleet.log'}")


def top_fleet(urls: list[str], interval: float, once: bool, json_out: bool, api_key: str | None) -> bool:
    """`agentbox top` over several backends or a fleet's router; False when `urls` is one plain server."""
    from agentbox.tui.fleet_view import is_fleet

    if not is_fleet(urls):
        return False
    if once:
        import json

        from rich.console import Console

        from agentbox.tui.fleet_view import fleet_once

        snaps, view = fleet_once(urls, api_key)
        if json_out:
            typer.echo(json.dumps(snaps, indent=2, default=str))
        else:
            Console(width=max(Console().width, 140)).print(view)
        if not any(s["up"] for s in snaps):
            raise typer.Exit(1)
        return True
    if json_out:
        fail("--json goes with --once")
    from agentbox.tui.fleet_view import FleetApp

    FleetApp(urls, interval, api_key).run()
    return True


def doctor_urls(urls: list[str], json_out: bool, api_key: str | None) -> None:
    """`agentbox doctor --url`: check each router and backend over HTTP (not this machine)."""
    import json
    from dataclasses import asdict

    from agentbox import fleet

    findings = fleet.diagnose(urls, api_key)
    if json_out:
        typer.echo(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            typer.secho(f"{'ok ' if f.ok else 'ERR'} {f.what}", fg=None if f.ok else "red")
            if f.fix:
                typer.echo(f"    fix: {f.fix}")
    if not all(f.ok for f in findings):
        raise typer.Exit(1)
