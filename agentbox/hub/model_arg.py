"""`serve --model X`: X is a path (an HF directory or a .gguf file), a profile name (`Qwen3-8B`, or
`Qwen3-8B:q4_k_m`; planned, pulled and checked by the chain) or a hub repo id (`owner/name`, fetched with a
progress bar into the models directory). Tried in that order; when nothing matches, the error names each
thing tried and the profiles whose names come close.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from agentbox.hub.profiles import Profile, ProfileError, find_profile, load_profiles, names_hint
from agentbox.hub.pull import MARKER, PullError, is_network_error, models_dir, pull, read_marker
from agentbox.invocation import agentbox_cmd
from agentbox.state_files import inside

# owner/name, as the hub spells repo ids; `:QUANT` picks one GGUF file of a repo that has several.
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
# What a safetensors repo needs to load: weights, config, tokenizer (not the READMEs, images or other formats).
SAFETENSORS_FILES = ("*.safetensors", "*.json", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab.txt")


class ModelArgError(ValueError):
    """--model named nothing that can be served; the message names what was tried and a fix."""


@dataclass(frozen=True)
class ModelChoice:
    path: Path
    tp: int | None  # the plan's tensor-parallel size for a profile; None: not planned (use --tp or 1)
    n_cpu_moe: int = 0  # the plan's MoE layers with their routed experts in host RAM (hub/offload.py)


def resolve_model_arg(arg: str, console: Console | None = None, **chain: object) -> ModelChoice:
    """The loadable path for --model `arg`. `chain`: keyword arguments for hub.chain.resolve_default (tests
    pass a probe, a verdict store or a canary runner)."""
    console = console or Console(stderr=True)
    path = Path(arg).expanduser()
    if path.exists():
        return ModelChoice(path, None)
    if _looks_like_path(arg):
        raise ModelArgError(f"--model {arg}: no such file or directory ({path.resolve()})")
    name, _, variant = arg.partition(":")
    try:
        profile: Profile | None = find_profile(name)
    except ProfileError:
        profile = None
    if profile is not None:
        if variant:
            try:
                profile.variant(variant)
            except ProfileError as exc:
                raise ModelArgError(f"--model {arg}: {exc}") from None
        return _from_profile(profile, variant or None, console, chain)
    if REPO_ID.match(arg):
        return ModelChoice(pull_repo(arg, console), None)
    raise ModelArgError(not_found_message(arg))


def _looks_like_path(arg: str) -> bool:
    return arg.startswith((".", "/", "~")) or arg.endswith(".gguf") or arg.count("/") > 1 or os.sep != "/" and os.sep in arg


def _from_profile(profile: Profile, variant: str | None, console: Console, chain: dict[str, object]) -> ModelChoice:
    from agentbox.hub.chain import ChainError, resolve_default

    if variant is not None:  # the user chose the variant: pull it if needed, no plan
        try:
            return ModelChoice(pull(profile, profile.variant(variant), console=console), None)
        except PullError as exc:
            raise ModelArgError(f"--model {profile.name}:{variant}: {exc}") from None
    try:
        resolved = resolve_default(profiles=[profile], named=True, console=console, **chain)  # type: ignore[arg-type]
    except ChainError as exc:
        raise ModelArgError(str(exc)) from None
    return ModelChoice(resolved.path, resolved.tp, resolved.n_cpu_moe)


def not_found_message(arg: str) -> str:
    return (f"--model {arg}: not a file or directory, not a known model, not a hub repo id (owner/name)\n"
            f"  {names_hint(arg, load_profiles())}")


def pull_repo(spec: str, console: Console) -> Path:
    """A hub repo by id (`owner/name`, or `owner/name:Q4_K_M` for one GGUF file of several) under
    models_dir()/owner/name; what is already there complete is used without asking the hub."""
    repo, _, quant = spec.partition(":")
    dest = models_dir().joinpath(*repo.split("/"))
    if (marker := dest / MARKER).is_file():
        load = read_marker(marker).get("load", ".")
        path = inside(dest, load) if isinstance(load, str) else None  # the marker is state: untrusted
        if path is not None:
            return path
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    tried = f"--model {spec}: not a file or directory, not a known model; as a hub repo id"
    try:
        files = HfApi().list_repo_files(repo, token=os.environ.get("HF_TOKEN") or None)
        patterns, load = _files_to_fetch(spec, files, quant)
        console.print(f"pulling {repo} ({', '.join(patterns)}) into {dest}", markup=False, highlight=False)
        snapshot_download(repo, allow_patterns=patterns, local_dir=dest, token=os.environ.get("HF_TOKEN") or None)
    except OfflineModeIsEnabled:
        raise ModelArgError(f"{tried}: HF_HUB_OFFLINE is set, so the hub was not asked\n  unset HF_HUB_OFFLINE, "
                            f"or serve a local path: {agentbox_cmd()} serve --model PATH") from None
    except GatedRepoError:
        raise ModelArgError(f"{tried}: {repo} is gated\n  accept its license on huggingface.co, then: "
                            f"HF_TOKEN=<your token> {agentbox_cmd()} serve --model {spec}") from None
    except RepositoryNotFoundError:
        raise ModelArgError(f"{tried}: the hub has no repo {repo} (or it is private: set HF_TOKEN)\n"
                            f"  {not_found_message(spec).splitlines()[1].strip()}") from None
    except HfHubHTTPError as exc:
        raise ModelArgError(f"{tried}: the hub refused ({str(exc).splitlines()[0]})") from None
    except Exception as exc:
        if not is_network_error(exc):
            raise
        raise ModelArgError(f"{tried}: the hub cannot be reached ({type(exc).__name__})\n"
                            f"  serve a local path instead: {agentbox_cmd()} serve --model PATH") from None
    (dest / MARKER).write_text(json.dumps({"model": repo, "repo": repo, "load": load}, indent=2))
    return dest / load


def _files_to_fetch(spec: str, files: list[str], quant: str) -> tuple[list[str], str]:
    """allow_patterns for the repo, and what to load below its directory ("." for an HF directory)."""
    ggufs = [f for f in files if f.endswith(".gguf")]
    if quant:
        ggufs = [f for f in ggufs if quant.lower() in Path(f).name.lower()]
        if len(ggufs) != 1:
            raise ModelArgError(f"--model {spec}: {len(ggufs)} GGUF files of {spec.split(':')[0]} match {quant!r}")
        return ggufs, ggufs[0]
    if any(f.endswith(".safetensors") for f in files):
        return list(SAFETENSORS_FILES), "."
    if len(ggufs) == 1:
        return ggufs, ggufs[0]
    if ggufs:
        quants = sorted({m.group(1) for f in ggufs if (m := re.search(r"[.-]((?:I?Q|F|BF)[\w]+?)\.gguf$", f, re.I))})
        raise ModelArgError(f"--model {spec}: the repo has {len(ggufs)} GGUF files; name one by its type, e.g. "
                            f"{agentbox_cmd()} serve --model {spec}:{quants[0] if quants else 'Q4_K_M'}\n"
                            f"  types there: {', '.join(quants[:12])}")
    raise ModelArgError(f"--model {spec}: the repo has neither safetensors nor GGUF weights")
