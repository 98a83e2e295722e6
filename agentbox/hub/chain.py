"""`agentbox serve` with no model: plan -> pull if needed -> verify -> a local path, printing each step.

Profiles with a `default_rank` are tried in that order (Qwen3-8B first, the embedded SmolLM2 last); within
one, the planner's accepted variants best first. A variant the canary rejected before (same GPU, driver and
engine version) is skipped without loading. Offline, only what is already local is tried. A CPU-only
machine never starts a multi-gigabyte download on its own: it tries only what is local (else the embedded
model), and names the one model agentbox suggests for agent work there (`suggest_model`), the same one
`plan`, `doctor` and a client's refusal name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from rich.console import Console

from agentbox.hub.embedded import INSTALL_HINT, embedded_model_path
from agentbox.hub.plan import Plan, PlanConfig, describe_machine, plan
from agentbox.hub.profiles import Profile, load_profiles
from agentbox.hub.pull import OfflineError, PullError, local_path, pull
from agentbox.hub.verify import Runner, Verdict, VerdictStore, engine_runner, verify
from agentbox.hw.probe import GIB, Probe
from agentbox.invocation import agentbox_cmd


class ChainError(RuntimeError):
    """No model could be resolved; the message says why and what to do, `steps` what was tried."""

    def __init__(self, message: str, steps: list[str] | None = None) -> None:
        super().__init__(message)
        self.steps = steps or []


@dataclass
class Resolved:
    path: Path
    model: str
    variant: str
    tp: int
    plan: Plan
    verdict: Verdict | None  # None when the canary could not run (engine not importable)
    steps: list[str] = field(default_factory=list)
    n_cpu_moe: int = 0  # the plan's MoE layers whose routed experts live in host RAM (hub/offload.py)


def default_profiles() -> list[Profile]:
    ranked = [p for p in load_profiles() if p.default_rank is not None]
    return sorted(ranked, key=lambda p: (p.default_rank, p.name))


def resolve_default(
    *,
    probe: Probe | None = None,
    config: PlanConfig | None = None,
    offline: bool | None = None,
    runner: Runner | None = None,
    store: VerdictStore | None = None,
    console: Console | None = None,
    profiles: list[Profile] | None = None,
    named: bool = False,
) -> Resolved:
    """`named`: the user asked for these profiles (`serve --model Qwen3-8B`): a CPU-only machine pulls them
    too, and the error names them."""
    console = console or Console(stderr=True)
    steps: list[str] = []

    def say(msg: str) -> None:
        steps.append(msg)
        console.print(msg, markup=False, highlight=False, soft_wrap=True)  # a pipe gets whole lines

    if probe is None:
        from agentbox.hw.probe import probe as measure

        probe = measure()
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    say(f"probe: {describe_machine(probe)}")
    # A CPU-only machine never pulls on its own: only what is here is tried, and what is not is left unsaid
    # (the suggestion at the end names the one model to pull instead of a list of skipped plans).
    local_only = probe.cpu_only and not named
    for profile in profiles if profiles is not None else default_profiles():
        p = plan(profile, probe, config)
        if p.chosen is None:
            if not local_only:
                first = p.candidates[0].reasons[0] if p.candidates else "no variants"
                say(f"plan {profile.name}: no variant runs here ({first})")
            continue
        for cand in p.accepted:
            v = cand.variant
            label = f"{profile.name}:{v.name}"
            path = local_path(profile, v)
            if path is None and local_only:
                continue
            n_cpu_moe = cand.split.in_ram if cand.split is not None else 0
            split = f" {cand.split.serve_flag}" if cand.split is not None else ""
            say(f"plan {label} tp={cand.tp}{split}: {cand.arithmetic}")
            if path is None:
                if offline:
                    say("  skip: not downloaded and offline")
                    continue
                say(f"pull {label} ({v.size / GIB:.1f} GiB)")
                try:
                    path = pull(profile, v, console=console)
                except OfflineError as exc:
                    offline = True
                    say(f"  skip: {exc}")
                    continue
                except PullError as exc:
                    say(f"  skip: {exc}")
                    continue
            say(f"verify {label}: canary at {path}")
            try:
                # The canary runs at the plan's tp and experts' placement: a model planned across two GPUs, or with
                # experts in host RAM, does not fit one GPU.
                verdict: Verdict | None = verify(
                    path, v.name, probe, model=profile.name,
                    runner=runner or partial(engine_runner, tp=cand.tp, n_cpu_moe=n_cpu_moe), store=store,
                )
            except ImportError as exc:  # no engine in this install: nothing was learned about the model
                say(f"  canary skipped: the engine does not import ({exc})")
                verdict = None
            if verdict is not None and not verdict.ok:
                say(f"  rejected{' (remembered)' if verdict.cached else ''}: {verdict.reason}")
                continue
            if verdict is not None:
                say(f"  ok{' (remembered)' if verdict.cached else ''}")
            if v.source == "embedded" and (hint := agent_work_hint(probe, config)):
                say(hint)
            return Resolved(path, profile.name, v.name, cand.tp, p, verdict, steps, n_cpu_moe)
    if named and profiles:
        names = ", ".join(p.name for p in profiles)
        raise ChainError(
            f"{names} cannot be served on this machine (the lines above say why)\n"
            f"  the memory arithmetic of each variant: {agentbox_cmd()} plan {profiles[0].name}", steps
        )
    raise ChainError(no_model_message(probe), steps)


def first_servable(probe: Probe, config: PlanConfig | None = None, offline: bool | None = None) -> str | None:
    """What `serve` with no model would load first, judged without loading anything (no canary): a planned
    variant already here, or one it would pull (not on a CPU-only machine, not offline). None: serve cannot
    start. For `agentbox doctor`."""
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    for profile in default_profiles():
        for cand in plan(profile, probe, config).accepted:
            label = f"{profile.name}:{cand.variant.name}"
            if local_path(profile, cand.variant) is not None:
                return f"{label} (on this machine)"
            if not probe.cpu_only and not offline and cand.variant.source != "embedded":
                return f"{label} (pulled on first serve, {cand.variant.size / GIB:.1f} GiB)"
    return None


@dataclass(frozen=True)
class Suggestion:
    """The model agentbox suggests for agent work on a machine, as its plan there has it."""

    model: str
    variant: str
    context: int  # planned context per session
    need: int  # bytes per device it takes, by the plan
    available: int  # bytes per device it is planned against
    local: bool  # already downloaded

    def describe(self) -> str:
        how = "on this machine" if self.local else "pulled on first serve"
        return (f"{agentbox_cmd()} serve --model {self.model}   ({self.variant} at a {self.context:,}-token context "
                f"takes {self.need / GIB:.1f} of {self.available / GIB:.1f} GiB; {how})")


def suggest_model(probe: Probe, min_context: int = 0, config: PlanConfig | None = None) -> Suggestion | None:
    """The one model agentbox suggests for agent work on this machine: the first ranked default profile with a
    variant planned to run here at an agent's context (config.PLAN_CONTEXT, or `min_context` when larger),
    never the embedded model (8k tokens: too small for any agent's own prompt). `serve` on a CPU box, `plan`,
    `doctor` and a client refused for its context all name this one. None: no known model fits."""
    base = config or PlanConfig()
    want = max(min_context, base.default_context)
    # The machine at rest: a suggestion that moved with the page cache would tell two stories a minute apart.
    rested = replace(probe, host=replace(probe.host, ram_free=probe.host.ram_total))
    for profile in default_profiles():
        if profile.context_length < want:
            continue
        p = plan(profile, rested, replace(base, context=want))
        cand = next((c for c in p.accepted if c.variant.source != "embedded"), None)
        if cand is not None:
            return Suggestion(profile.name, cand.variant.name, p.context, cand.need_per_device,
                              cand.available_bytes, local_path(profile, cand.variant) is not None)
    return None


def agent_work_hint(probe: Probe, config: PlanConfig | None = None) -> str:
    """What `serve` says after starting the embedded model: it is for trying things, and what to serve instead."""
    found = suggest_model(probe, config=config)
    if found is None:
        return ("note: the embedded SmolLM2 (8k context) is for trying agentbox, too small for coding agents; no "
                f"known model fits this machine for them ({agentbox_cmd()} plan MODEL shows the arithmetic)")
    return ("note: the embedded SmolLM2 (8k context) is for trying agentbox, too small for coding agents; for "
            f"them: {found.describe()}")


def no_model_message(probe: Probe) -> str:
    """Why nothing can be served, and the fix, in two lines: the chain's steps were printed as they ran."""
    if embedded_model_path() is None:
        where = "this machine has no GPU and " if probe.cpu_only else ""
        return (
            f"no model to serve: {where}the embedded SmolLM2 is not installed\n"
            f"  fix: {INSTALL_HINT}"
        )
    return (
        "no model to serve: every candidate was skipped or rejected (the lines above say why)\n"
        f"  fix: name one: {agentbox_cmd()} serve --model MODEL (a path, a profile such as Qwen3-8B, or owner/repo)"
    )
