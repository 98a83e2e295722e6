"""`agentbox pull MODEL[:VARIANT]`: fetch only one variant's files from the Hugging Face hub, with progress.

Models live under state_dir()/models/<model>/<variant>/ as plain files (not the HF cache): one directory
per variant is what the engine loads, what `agentbox models` lists, and what a user can delete by hand.
Sizes come from the hub's HEAD metadata before the first byte, and are checked against free disk.
A file downloads to `<name>.incomplete` (with its ETag beside it) and continues with a Range request
after an interruption; a finished variant gets a `.agentbox.json` marker, written last.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from agentbox.config import state_dir
from agentbox.hub.embedded import EMBEDDED_PACKAGE, INSTALL_HINT, embedded_model_path
from agentbox.hub.profiles import Profile, Variant, find_profile
from agentbox.hw.probe import GIB
from agentbox.invocation import pip_cmd
from agentbox.state_files import inside

MARKER = ".agentbox.json"
DEFAULT_ENDPOINT = "https://huggingface.co"


class PullError(RuntimeError):
    """A download that cannot proceed; the message says what to do."""


class OfflineError(PullError):
    pass


class DiskSpaceError(PullError):
    pass


@dataclass(frozen=True)
class RemoteFile:
    name: str
    url: str
    size: int
    etag: str | None
    commit: str | None


@dataclass(frozen=True)
class LocalModel:
    model: str
    variant: str
    path: Path  # what EngineConfig(model=...) takes: the directory, or the .gguf file
    size: int  # bytes on disk
    complete: bool
    embedded: bool = False


def models_dir() -> Path:
    return state_dir() / "models"


def variant_dir(profile: Profile, variant: Variant) -> Path:
    return models_dir() / profile.name / variant.name


def parse_spec(spec: str) -> tuple[Profile, Variant | None]:
    """`Qwen3-8B` or `Qwen3-8B:q4_k_m` (a repo id works in place of the name)."""
    name, _, variant = spec.partition(":")
    profile = find_profile(name)
    return profile, profile.variant(variant) if variant else None


def local_path(profile: Profile, variant: Variant) -> Path | None:
    """The loadable path of a variant when it is fully on this machine, else None."""
    if variant.source == "embedded":
        return embedded_model_path()
    d = variant_dir(profile, variant)
    if not (d / MARKER).is_file():
        return None
    return _model_path(d, variant)


def _model_path(d: Path, variant: Variant) -> Path:
    if variant.is_gguf:  # the engine loads the .gguf file itself; its tokenizer is inside it
        return d / next(f for f in variant.files if f.endswith(".gguf"))
    return d


def pull(
    profile: Profile,
    variant: Variant,
    *,
    revision: str = "main",
    token: str | None = None,
    endpoint: str | None = None,
    console: Console | None = None,
    keep_free: int = 1 << 30,
    retries: int = 3,
) -> Path:
    """Download `variant` (only its files) and return its loadable path. Resumes what is partly there.

    `keep_free`: bytes of disk that must remain free after the download. `retries`: how many times an
    interrupted transfer continues (with a Range request) before giving up; a later pull continues too.
    """
    if variant.source == "embedded":
        path = embedded_model_path()
        if path is None:
            raise PullError(f"{profile.name}:{variant.name} ships in a Python package: {INSTALL_HINT}")
        return path
    if (done := local_path(profile, variant)) is not None:
        return done
    console = console or Console(stderr=True)
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    token = token or os.environ.get("HF_TOKEN") or None
    dest = variant_dir(profile, variant)
    # The hub is asked before the directory exists: an offline or refused pull leaves nothing behind (an empty
    # directory was listed as a "partial" model forever).
    remote = [_metadata(endpoint, variant.repo, revision, name, token) for name in variant.files]
    dest.mkdir(parents=True, exist_ok=True)
    have = {f.name: _bytes_present(dest, f) for f in remote}
    needed = sum(f.size - have[f.name] for f in remote)
    free = shutil.disk_usage(dest).free
    if needed + keep_free > free:
        _drop_if_empty(dest)
        raise DiskSpaceError(
            f"{profile.name}:{variant.name} needs {needed / GIB:.2f} GiB more (+{keep_free / GIB:.1f} GiB kept free) "
            f"but {dest} has {free / GIB:.2f} GiB free; free some space or set AGENTBOX_HOME to a larger disk"
        )
    console.print(
        f"pulling {profile.name}:{variant.name} from {variant.repo} — {len(remote)} files, "
        f"{sum(f.size for f in remote) / GIB:.2f} GiB ({needed / GIB:.2f} GiB to fetch) into {dest}"
    )
    headers = _auth_headers(token)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with (
        Progress(*columns, console=console, transient=False) as bars,
        httpx.Client(
            headers=headers, follow_redirects=True, timeout=httpx.Timeout(30.0, read=120.0)
        ) as client,
    ):
        total = bars.add_task("[bold]total", total=sum(f.size for f in remote), completed=sum(have.values()))
        for f in remote:
            task = bars.add_task(f"  {f.name}", total=f.size, completed=have[f.name])
            advance: Callable[[int], None] = _advancer(bars, total, task)
            _fetch_with_retries(client, f, dest, advance, retries)
    _write_marker(dest, profile, variant, revision, remote)
    return _model_path(dest, variant)


def _advancer(bars: Progress, total: TaskID, task: TaskID) -> Callable[[int], None]:
    def advance(n: int) -> None:
        bars.advance(total, n)
        bars.advance(task, n)

    return advance


def _metadata(endpoint: str, repo: str, revision: str, name: str, token: str | None) -> RemoteFile:
    from huggingface_hub import get_hf_file_metadata
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled

    url = f"{endpoint}/{repo}/resolve/{quote(revision, safe='')}/{quote(name)}"
    try:
        meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    except OfflineModeIsEnabled as exc:
        raise OfflineError(
            f"HF_HUB_OFFLINE is set, so {repo} cannot be downloaded; unset it or pull later"
        ) from exc
    except GatedRepoError as exc:
        raise PullError(
            f"{repo} is gated: accept its license on the hub, then set HF_TOKEN=<your token>"
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise PullError(
                f"{repo} refused access ({status}): set HF_TOKEN=<your token> for gated or private repos"
            ) from exc
        if status == 404:
            raise PullError(f"{repo}@{revision} has no file {name!r} (HTTP 404)") from exc
        raise PullError(f"{url}: {exc}") from exc
    except Exception as exc:  # connection refused, DNS, timeouts: the hub's http client raises its own types
        if is_network_error(exc):
            raise OfflineError(
                f"cannot reach {endpoint} ({type(exc).__name__}); you appear to be offline. "
                f"Models already pulled still work: `agentbox models` lists them"
            ) from exc
        raise
    if meta.size is None:
        raise PullError(f"{url}: the hub did not report a size")
    return RemoteFile(name, url, int(meta.size), meta.etag, meta.commit_hash)


def is_network_error(exc: BaseException) -> bool:
    """A failure to reach the hub (DNS, refused, timeout), whichever HTTP client the hub library uses."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(
        names & {"TransportError", "ConnectError", "TimeoutException", "NetworkError", "ConnectionError"}
    ) or (isinstance(exc, OSError))


def _auth_headers(token: str | None) -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets into the file, not a gzip stream
    return headers


def _partial(dest: Path, f: RemoteFile) -> tuple[Path, Path]:
    return dest / f"{f.name}.incomplete", dest / f"{f.name}.incomplete.etag"


def _bytes_present(dest: Path, f: RemoteFile) -> int:
    """Bytes already here for this file: all of it when finished, the partial's length when its ETag matches."""
    final = dest / f.name
    if final.is_file() and final.stat().st_size == f.size:
        return f.size
    part, etag_file = _partial(dest, f)
    if part.is_file() and etag_file.is_file() and etag_file.read_text() == (f.etag or ""):
        return min(part.stat().st_size, f.size)
    part.unlink(missing_ok=True)  # a partial of another version of the file: start over
    return 0


def _fetch_with_retries(
    client: httpx.Client, f: RemoteFile, dest: Path, advance: Callable[[int], None], retries: int
) -> None:
    for attempt in range(retries + 1):
        try:
            _fetch(client, f, dest, advance)
            return
        except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
            if attempt == retries:
                raise PullError(
                    f"download of {f.name} was interrupted ({type(exc).__name__}); run the same pull again to continue"
                ) from exc


def _fetch(client: httpx.Client, f: RemoteFile, dest: Path, advance: Callable[[int], None]) -> None:
    final = dest / f.name
    if final.is_file() and final.stat().st_size == f.size:
        return
    part, etag_file = _partial(dest, f)
    part.parent.mkdir(parents=True, exist_ok=True)
    etag_file.write_text(f.etag or "")
    start = part.stat().st_size if part.is_file() else 0
    headers = {"Range": f"bytes={start}-"} if start else {}
    with client.stream("GET", f.url, headers=headers) as response:
        if response.status_code == 416 and start >= f.size:  # the partial already holds every byte
            pass
        else:
            if response.status_code in (401, 403):
                raise PullError(f"{f.url} refused access: set HF_TOKEN=<your token>")
            response.raise_for_status()
            if start and response.status_code == 200:  # the server ignored Range: start over
                advance(-start)
                start = 0
            with part.open("ab" if start else "wb") as out:
                for (
                    chunk
                ) in response.iter_bytes():  # as received: a chunk size would hold bytes back from disk
                    out.write(chunk)
                    advance(len(chunk))
    got = part.stat().st_size
    if got != f.size:
        raise httpx.RemoteProtocolError(f"{f.name}: got {got} of {f.size} bytes")
    part.replace(final)
    etag_file.unlink(missing_ok=True)


def _write_marker(
    dest: Path, profile: Profile, variant: Variant, revision: str, remote: list[RemoteFile]
) -> None:
    info = {
        "model": profile.name,
        "variant": variant.name,
        "repo": variant.repo,
        "revision": revision,
        "commit": next((f.commit for f in remote if f.commit), None),
        "files": {f.name: {"size": f.size, "etag": f.etag} for f in remote},
    }
    (dest / MARKER).write_text(json.dumps(info, indent=2))


def _drop_if_empty(dest: Path) -> None:
    """A variant directory with no byte in it, and its model directory if that is left empty too."""
    for d in (dest, dest.parent):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def remove_local(spec: str) -> list[LocalModel]:
    """`agentbox models --rm SPEC`: every local model `MODEL:VARIANT` (or all variants of `MODEL`, or an
    `owner/name` pulled by repo id) names, complete or partial, deleted from disk. Returns what was removed;
    PullError when nothing matches or the spec names the embedded model (a Python package, not a download)."""
    name, _, variant = spec.partition(":")
    local = list_local()
    hits = [m for m in local if (m.model.lower() == name.lower() and variant.lower() in ("", m.variant.lower()))
            or f"{m.model}/{m.variant}".lower() == spec.lower()]
    if any(m.embedded for m in hits):
        raise PullError(f"{spec} is the embedded model: it ships in the Python package {EMBEDDED_PACKAGE}, "
                        f"removed with: {pip_cmd()} uninstall {EMBEDDED_PACKAGE}")
    if not hits:
        listed = ", ".join(f"{m.model}:{m.variant}" for m in local if not m.embedded) or "none"
        raise PullError(f"no local model {spec!r}; on this machine: {listed} (agentbox models)")
    for m in hits:
        d = models_dir() / m.model / m.variant
        shutil.rmtree(d)
        _drop_if_empty(d)  # and its model's directory, when that was its last variant
    return hits


def read_marker(path: Path) -> dict:
    """A variant's marker (state: untrusted): {} when it does not parse as an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def list_local() -> list[LocalModel]:
    """Every variant under models_dir() (complete or partial) plus the embedded model when installed."""
    found: list[LocalModel] = []
    root = models_dir()
    for d in sorted(p for p in root.glob("*/*") if p.is_dir()) if root.is_dir() else []:
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        marker = d / MARKER
        path = d
        if marker.is_file():
            files = read_marker(marker).get("files", {})
            ggufs = [n for n in files if isinstance(n, str) and n.endswith(".gguf")] if isinstance(files, dict) else []
            path = (inside(d, ggufs[0]) or d) if ggufs else d
        found.append(LocalModel(d.parent.name, d.name, path, size, marker.is_file()))
    if (emb := embedded_model_path()) is not None:
        found.append(
            LocalModel("SmolLM2-135M-Instruct", "embedded", emb, emb.stat().st_size, True, embedded=True)
        )
    return found
