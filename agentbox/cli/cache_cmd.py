"""`agentbox cache`: owns the commands over the disk KV tier (engine/cache/disk_tier.py): `show` lists each
model namespace (model, size, chunks, sessions, oldest entry) and, when a server runs, its live tiers;
`clear` removes namespaces. Reads the files directly: no engine, no torch."""

from __future__ import annotations

import time

import typer

cache_app = typer.Typer(help="show or clear the KV cache kept on disk across restarts",
                        invoke_without_command=True)


@cache_app.callback()
def cache_root(ctx: typer.Context) -> None:
    """Show or clear the KV cache kept on disk (no command: show)."""
    if ctx.invoked_subcommand is None:
        show()


def _age(t: float | None) -> str:
    if t is None:
        return "-"
    s = max(0.0, time.time() - t)
    return f"{s / 86400:.1f} d" if s >= 86400 else f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def _live() -> str | None:
    """The running server's tiers, one line; None when none runs."""
    import httpx

    from agentbox.cli import daemon

    st = daemon.read_state()
    if st is None:
        return None
    headers = {"Authorization": f"Bearer {st['api_key']}"} if st.get("api_key") else {}
    try:
        c = httpx.get(daemon.url_of(st) + "/v1/stats", headers=headers, timeout=5).json()["cache"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return (f"running server: {c['gpu_pages']} pages in the pool, {c['host_pages']} on the host tier, "
            f"{c.get('disk_pages', 0)} on disk ({c.get('disk_restored', 0)} read back, "
            f"{c.get('disk_torn', 0)} torn chunks dropped)")


@cache_app.command("show")
def show() -> None:
    """List what is on disk, per model.

    Each namespace's size, chunks, pages, sessions and oldest entry."""
    from agentbox.engine.cache.disk_listing import disk_root, namespaces

    found = namespaces()
    typer.echo(f"disk KV cache in {disk_root()}")
    if not found:
        typer.echo("  empty (a server writes here when pages leave memory and when it stops)")
    for ns in found:
        typer.echo(f"  {ns.key[:12]}  {ns.bytes / 2**30:6.2f} GiB  {ns.chunks:5d} chunks  {ns.pages:6d} pages"
                   f"  {ns.sessions:3d} sessions  oldest {_age(ns.oldest):>8}  {ns.model}")
    if (live := _live()) is not None:
        typer.echo(live)


@cache_app.command("clear")
def clear(
    namespace: str | None = typer.Argument(None, help="a namespace (its first characters); default: all"),  # noqa: UP007
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask first"),
) -> None:
    """Remove namespaces from disk (asks first unless --yes).

    A running server recomputes what it then misses."""
    from agentbox.cli.common import fail
    from agentbox.engine.cache.disk_listing import clear as clear_ns
    from agentbox.engine.cache.disk_listing import namespaces

    doomed = [ns for ns in namespaces() if namespace is None or ns.key.startswith(namespace)]
    if not doomed:
        if namespace is not None:
            fail(f"no namespace starts with {namespace!r}; `agentbox cache show` lists them")
        typer.echo("nothing to remove: the disk KV cache is empty")
        return
    what = (f"{len(doomed)} namespace(s), {sum(ns.bytes for ns in doomed) / 2**30:.2f} GiB of saved sessions "
            f"({', '.join(sorted({ns.model for ns in doomed}))})")
    if not yes:
        import sys

        if not sys.stdin.isatty():  # a script: nothing to ask, and nothing removed by default
            fail(f"this removes {what}; pass --yes to do it without a terminal to confirm at")
        if not typer.confirm(f"remove {what}?", default=False):
            typer.echo("kept everything")
            raise typer.Exit(1)
    gone = clear_ns(namespace)
    typer.echo(f"removed {len(gone)} namespace(s): " + ", ".join(k[:12] for k in gone))
