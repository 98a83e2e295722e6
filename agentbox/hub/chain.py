"""`agentbox serve` with no model: plan -> pull if needed -> verify -> a local path, printing each step.

Profiles with a `default_rank` are tried in that order (Qwen3-8B first, the embedded SmolLM2 last); within
one, the planner's accepted variants best first. A variant the canary rejected before (same GPU, driver and
engine version) is skipped without loading. Offline, only what is already local is tried. A CPU-only
machine never starts a multi-gigabyte download on its own: it uses what is local, else the embedded model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from rich.console import Console

from agentbox.hub.embedded import INSTALL_HINT
from agentbox.hub.plan import Plan, PlanConfig, describe_machine, plan
from agentbox.hub.profiles import Profile, load_profiles
from agentbox.hub.pull import OfflineError, PullError, local_path, pull
from agentbox.hub.verify import Runner, Verdict, VerdictStore, engine_runner, verify
from agentbox.hw.probe import Probe


class ChainError(RuntimeError):
    """No model could be resolved; the message lists what was tried and what to do."""


@dataclass
class Resolved:
    path: Path
    model: str
    variant: str
    tp: int
    plan: Plan
    verdict: Verdict | None  # None when the canary could not run (engine not importable)
    steps: list[str] = field(default_factory=list)


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
) -> Resolved:
    console = console or Console(stderr=True)
    steps: list[str] = []

    def say(msg: str) -> None:
        steps.append(msg)
        console.print(msg)

    if probe is None:
        from agentbox.hw.probe import probe as measure

        probe = measure()
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    say(f"[bold]probe[/]: {describe_machine(probe)}")
    for profile in profiles if profiles is not None else default_profiles():
        p = plan(profile, probe, config)
        if p.chosen is None:
            first = p.candidates[0].reasons[0] if p.candidates else "no variants"
            say(f"[bold]plan[/] {profile.name}: no variant runs here ({first})")
            continue
        for cand in p.accepted:
            v = cand.variant
            label = f"{profile.name}:{v.name}"
            say(f"[bold]plan[/] {label} tp={cand.tp}: {cand.arithmetic}")
            path = local_path(profile, v)
            if path is None:
                if probe.cpu_only:
                    say(
                        f"  skip: not downloaded, and a CPU-only machine does not pull on its own (agentbox pull {label})"
                    )
                    continue
                if offline:
                    say("  skip: not downloaded and offline")
                    continue
                say(f"[bold]pull[/] {label} ({v.size / 1e9:.1f} GB)")
                try:
                    path = pull(profile, v, console=console)
                except OfflineError as exc:
                    offline = True
                    say(f"  skip: {exc}")
                    continue
                except PullError as exc:
                    say(f"  skip: {exc}")
                    continue
            say(f"[bold]verify[/] {label}: canary at {path}")
            try:
                # The canary runs at the plan's tp: a model planned across two GPUs does not fit one.
                verdict: Verdict | None = verify(
                    path, v.name, probe, model=profile.name, runner=runner or partial(engine_runner, tp=cand.tp),
                    store=store,
                )
            except ImportError as exc:  # no engine in this install: nothing was learned about the model
                say(f"  canary skipped: the engine does not import ({exc})")
                verdict = None
            if verdict is not None and not verdict.ok:
                say(f"  rejected{' (remembered)' if verdict.cached else ''}: {verdict.reason}")
                continue
            if verdict is not None:
                say(f"  ok{' (remembered)' if verdict.cached else ''}")
            return Resolved(path, profile.name, v.name, cand.tp, p, verdict, steps)
    raise ChainError(
        "no model could be resolved on this machine:\n  "
        + "\n  ".join(steps)
        + f"\nThe embedded fallback model needs: {INSTALL_HINT}"
    )
