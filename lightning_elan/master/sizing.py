"""The AM sizes a job by itself: EDL's profile, Or et al.'s autoscaler and straggler replacement (pure state logic).

Everything acts through the job's ordinary scale requests (``transitions.requests.scale`` /
``transitions.leaving.request_leave``) with a ``cause`` that names the decision and its inputs, so every resize it
makes is a live adjustment like any other (survivors never restart, each sample once per epoch) and lands in
``adjustments.jsonl`` with its reason. :func:`tick` runs on the AM's loop; it acts only between adjustments (nothing
pending, nothing in flight, no recovery), once the current generation has been measured long enough (``measure.py``).

* **Profile** (EDL §5, ``elan profile``): visit each world size of ``[min, max]`` (``ProfileRun``), ``steps`` measured
  steps each, record samples/s per size, then settle back (or on the best size). The result is kept in the job's
  state, shown by ``elan status`` and written as a ``ThroughputModel`` JSON usable as ``HybridScaling(profile=…)``.
* **Autoscaler** (Or et al. §3–4): every ``every`` measured steps, after ``cooldown_s``, ask the policy
  (``ThroughputAutoscaler`` or ``UtilityAutoscaler``) for a size within ``[min_workers, max_workers]``.
* **Stragglers** (Or et al. Alg. 1, EDL §3.3): the detector flags a member whose compute-throughput EWMA stays below
  the threshold; ``replace`` adds one worker and removes the straggler once the replacement has joined, ``remove``
  removes it (or ``replace`` does when no worker can be added), ``off`` only reports.

Jobs of ``elan worker``s cannot start workers themselves: growth there runs the user's ``scale_out_command`` (the
server does, outside the state transaction: :func:`tick` returns how many workers to ask for).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lightning_elan.master.narration import plural
from lightning_elan.master.transitions import leaving, requests
from lightning_elan.protocol.contract import (
    AutoscaleReply,
    AutoscaleRequest,
    ProfileReply,
    ProfileRequest,
    StragglerSettings,
    StragglersReply,
    StragglersRequest,
)
from lightning_elan.scaling.throughput import ThroughputModel
from lightning_elan.sizing.autoscale import ThroughputAutoscaler, UtilityAutoscaler, UtilityFunction
from lightning_elan.sizing.profile import ProfileRun

if TYPE_CHECKING:
    from lightning_elan.master.state import JobState

STRAGGLER_MODES = ("off", "replace", "remove")
AUTOSCALE_POLICIES = ("throughput", "utility", "off")
SETTLE_MODES = ("return", "best")
DEFAULT_AUTOSCALE_EVERY = 20
DEFAULT_COOLDOWN_S = 0.0
PROFILE_FILE = "profile.json"
SCALE_OUT_WAIT_S = 600.0  # workers asked for with the scale-out command are awaited this long before asking again
BACKWARD_RATIO = 2.0  # backward ≈ 2 forwards (StepTimer's default) when a profile becomes a ThroughputModel


class SizingError(ValueError):
    """A sizing request that cannot be carried out (the message says why)."""


# ---- requests (from `elan profile`, `elan autoscale`, `--stragglers`) ------------------------------------------------


def start_profile(state: JobState, request: ProfileRequest, now: float) -> ProfileReply:
    """Begin a profile of the running job over ``[min, max]``."""
    sizing = state.sizing
    if sizing.profile is not None:
        raise SizingError("a profile of this job is already running")
    if sizing.autoscale is not None:
        raise SizingError("the autoscaler is on: stop it first (`elan autoscale --policy off`)")
    low, high, current = int(request.min), int(request.max), state.world_size
    if state.enrolment is not None and high > current and not sizing.scale_out_command:
        raise SizingError(f"the workers of job {state.job} are started by their scheduler: --max {high} above the "
                          f"current size {current} needs the AM's --scale-out-command")
    try:
        run = ProfileRun(low, high, current, steps=int(request.steps or 20), settle=request.settle or "return")
    except ValueError as error:
        raise SizingError(f"profile: {error}") from None
    if not state.started or state.finished:
        raise SizingError(f"job {state.job} is not running")
    sizing.profile = {"run": run.to_dict(), "measured": {}, "compute": {}, "started_at": now}
    sizing.profile_result = None
    sizing.note("profile", "start", f"profile world sizes {low}..{high} from size {current}",
                {"min": low, "max": high, "steps": run.steps, "settle": run.settle}, now)
    return ProfileReply(sizing.profile)


def set_autoscale(state: JobState, request: AutoscaleRequest, now: float) -> AutoscaleReply:
    """Switch the autoscaler on (or ``off``) with its policy and bounds."""
    sizing, policy = state.sizing, request.policy
    if policy not in AUTOSCALE_POLICIES:
        raise SizingError(f"unknown autoscale policy {policy!r} (expected one of {', '.join(AUTOSCALE_POLICIES)})")
    if request.scale_out_command:
        sizing.scale_out_command = request.scale_out_command
    if policy == "off":
        sizing.autoscale = None
        sizing.note("autoscale", "off", "the autoscaler was switched off", {}, now)
        return AutoscaleReply(None)
    if sizing.profile is not None:
        raise SizingError("a profile of this job is running: wait for it to finish")
    config = _autoscale_config(state, request)
    policy_state = _new_policy(policy, config).to_dict()
    sizing.autoscale = {"policy": policy, "config": config, "state": policy_state, "last_size_at": now, "on_at": now}
    sizing.note("autoscale", "on", f"{policy} policy", config, now)
    return AutoscaleReply({"policy": policy, "config": config})


def _autoscale_config(state: JobState, request: AutoscaleRequest) -> dict[str, Any]:
    low, high = int(request.min_workers or 1), request.max_workers
    config = {
        "every": int(request.every or DEFAULT_AUTOSCALE_EVERY), "step": int(request.step or 1),
        "threshold": 0.1 if request.threshold is None else float(request.threshold),
        "min_workers": low, "max_workers": None if high is None else int(high),
        "cooldown_s": float(request.cooldown_s or DEFAULT_COOLDOWN_S),
        "price": None if request.price is None else float(request.price), "utility": request.utility,
    }
    if config["every"] < 1:
        raise SizingError(f"every must be >= 1 step, got {config['every']}")
    if request.policy == "utility" and (config["price"] is None or config["utility"] is None):
        raise SizingError("the utility policy needs a price per worker-second and a utility function")
    return config


def _new_policy(policy: str, config: dict[str, Any]) -> ThroughputAutoscaler | UtilityAutoscaler:
    try:
        if policy == "throughput":
            return ThroughputAutoscaler(config["step"], config["threshold"], config["min_workers"],
                                        config["max_workers"])
        return UtilityAutoscaler(config["price"], UtilityFunction.from_dict(config["utility"]), config["step"],
                                 config["min_workers"], config["max_workers"])
    except ValueError as error:
        raise SizingError(str(error)) from None


def _load_policy(autoscale: dict[str, Any]) -> ThroughputAutoscaler | UtilityAutoscaler:
    if autoscale["policy"] == "throughput":
        return ThroughputAutoscaler.from_dict(autoscale["state"])
    return UtilityAutoscaler.from_dict(autoscale["state"])


def set_stragglers(state: JobState, request: StragglersRequest, now: float) -> StragglersReply:
    """Straggler handling: ``off`` (report only), ``replace`` or ``remove``; thresholds configurable."""
    mode = request.mode
    if mode not in STRAGGLER_MODES:
        raise SizingError(f"unknown straggler mode {mode!r} (expected one of {', '.join(STRAGGLER_MODES)})")
    detector = state.measured.detector
    alpha = detector.alpha if request.alpha is None else float(request.alpha)
    threshold = detector.threshold if request.threshold is None else float(request.threshold)
    window = detector.window if request.window is None else int(request.window)
    try:
        state.measured.detector = type(detector)(alpha=alpha, threshold=threshold, window=window)
    except ValueError as error:
        raise SizingError(str(error)) from None
    settings = StragglerSettings(mode, alpha, threshold, window)
    state.sizing.stragglers = settings.to_body()
    state.sizing.note("stragglers", mode, f"straggler handling {mode}", state.sizing.stragglers, now)
    return StragglersReply(settings)


# ---- the loop ----------------------------------------------------------------------------------------------------


def tick(state: JobState, now: float | None = None) -> int:
    """One look at the job; returns how many workers the scale-out command must ask for (jobs of `elan worker`s)."""
    now = time.time() if now is None else now
    if not _quiet(state):
        return 0
    if state.sizing.replacing is not None:
        return _finish_replacement(state, now)
    stragglers = state.measured.detector.stragglers()
    if stragglers and state.sizing.stragglers.get("mode", "off") != "off":
        return _handle_straggler(state, stragglers[0], now)
    if state.sizing.profile is not None:
        return _profile_step(state, now)
    if state.sizing.autoscale is not None:
        return _autoscale_step(state, now)
    return 0


def _quiet(state: JobState) -> bool:
    """Between adjustments: started, not finished, nothing queued or in flight, no recovery, a generation measured."""
    return (state.started and not state.finished and state.in_flight is None and not state.pending
            and state.recovery is None and state.measured.generation == state.generation)


def _resize(state: JobState, target: int, cause: dict[str, Any], now: float) -> int:
    """Ask for ``target`` workers; a job of `elan worker`s grows through the scale-out command instead."""
    current = state.world_size
    if target > current and state.enrolment is not None:
        asked = state.sizing.scale_out
        if asked is not None and asked["target"] > current and now - asked["at"] < SCALE_OUT_WAIT_S:
            return 0  # the workers asked for are on their way (they enrol and join by themselves)
        if not state.sizing.scale_out_command:
            state.sizing.note(cause["kind"], "refused", f"cannot grow to {target}: the workers are started by their "
                              "scheduler and the AM has no --scale-out-command; the autoscaler is switched off",
                              cause, now)
            state.sizing.autoscale = None  # it would ask again at every look
            return 0
        state.sizing.scale_out = {"target": target, "at": now}
        return target - current
    requests.scale(state, "to", size=target, now=now, cause=cause)
    return 0


# ---- profile -------------------------------------------------------------------------------------------------------


def _profile_step(state: JobState, now: float) -> int:
    profile = state.sizing.profile
    assert profile is not None
    run = ProfileRun.from_dict(profile["run"])
    measured = state.measured
    size = state.world_size
    if str(size) not in profile["measured"]:
        if measured.current.steps < run.steps or measured.current.rate is None:
            return 0
        profile["measured"][str(size)] = measured.current.rate
        profile["compute"][str(size)] = measured.slowest_compute(size)
    rates = {int(k): v for k, v in profile["measured"].items()}
    target = run.next_target(size, rates)
    if target is None:
        _finish_profile(state, run, rates, now)
        return 0
    cause = state.sizing.note("profile", f"to {target}", f"profile: measured {plural(size, 'worker')} at "
                              f"{rates.get(size, 0):.1f} samples/s; next size {target}", {"rates": rates}, now)
    return _resize(state, target, cause, now)


def _finish_profile(state: JobState, run: ProfileRun, rates: dict[int, float], now: float) -> None:
    profile = state.sizing.profile
    assert profile is not None
    result = run.result(rates)
    state.sizing.profile_result = {**result, "global_batch": state.progress.global_batch,
                                   "compute_s": profile["compute"], "seconds": now - profile["started_at"],
                                   "finished_at": now}
    state.sizing.profile = None
    state.sizing.note("profile", "done", f"profile finished: {json_rates(rates)}", {"rates": rates}, now)


def json_rates(rates: dict[int, float]) -> str:
    return ", ".join(f"{size}: {rate:.1f}/s" for size, rate in sorted(rates.items()))


def throughput_model(result: dict[str, Any], min_observations: int = 3) -> dict[str, Any] | None:
    """A finished profile as a ``ThroughputModel`` state (``HybridScaling(profile=…)``): at each size, the step time
    is ``global_batch / rate``; its compute is the slowest member's measured forward time × (1 + ``BACKWARD_RATIO``)
    (the members measure their forward pass only, see ``elastic/compute.py``; the ratio is ``StepTimer``'s default),
    at most the step; the rest is all-reduce."""
    global_batch = result.get("global_batch")
    if not global_batch:
        return None
    model = ThroughputModel(min_observations=min_observations)
    for size, rate in result["rates"].items():
        size = int(size)
        step_s = global_batch / rate
        forward = (result.get("compute_s") or {}).get(str(size))
        compute = step_s if forward is None else min(step_s, forward * (1 + BACKWARD_RATIO))
        for _ in range(min_observations):
            model.observe_step(-(-global_batch // size), size, compute, 0.0 if size == 1 else step_s - compute)
    return model.state_dict()


# ---- autoscaler ----------------------------------------------------------------------------------------------------


def _autoscale_step(state: JobState, now: float) -> int:
    autoscale = state.sizing.autoscale
    assert autoscale is not None
    config = autoscale["config"]
    if state.measured.current.steps < config["every"] or now - autoscale["last_size_at"] < config["cooldown_s"]:
        return 0
    policy = _load_policy(autoscale)
    rates = state.measured.rates()
    size = state.world_size
    if autoscale["policy"] == "throughput":
        decision = policy.decide(size, rates)
    else:
        remaining = state.progress.remaining_samples
        if remaining is None:
            return 0
        # completion times (the utility's deadlines) count from the moment the autoscaler was switched on
        decision = policy.decide(size, rates, float(remaining), now - autoscale.get("on_at", now))
    autoscale["state"] = policy.to_dict()
    autoscale["last_size_at"] = now
    if decision is None or decision.target == size:
        if not _last_was_hold(state):
            state.sizing.note("autoscale", "hold", decision.reason if decision else "the search holds",
                              decision.inputs if decision else {"rates": rates}, now)
        return 0
    cause = state.sizing.note("autoscale", f"to {decision.target}", decision.reason, decision.inputs, now)
    return _resize(state, decision.target, cause, now)


def _last_was_hold(state: JobState) -> bool:
    decisions = state.sizing.decisions
    return bool(decisions) and decisions[-1]["kind"] == "autoscale" and decisions[-1]["decision"] == "hold"


# ---- stragglers ----------------------------------------------------------------------------------------------------


def _handle_straggler(state: JobState, straggler: str, now: float) -> int:
    mode = state.sizing.stragglers["mode"]
    score = state.measured.detector.scores().get(straggler)
    inputs = {"straggler": straggler, "score": score, "threshold": state.sizing.stragglers.get("threshold")}
    can_add = state.enrolment is None or bool(state.sizing.scale_out_command)
    if mode == "replace" and can_add:
        cause = state.sizing.note("straggler", "replace", f"{straggler} computes at {score:.2f} of the median: "
                                  "adding a replacement before removing it", inputs, now)
        state.sizing.replacing = {"straggler": straggler, "size": state.world_size, "since": now}
        if state.enrolment is not None:
            state.sizing.scale_out = {"target": state.world_size + 1, "at": now}
            return 1
        requests.scale(state, "add", count=1, now=now, cause=cause)
        return 0
    return _remove_straggler(state, straggler, inputs, now)


def _finish_replacement(state: JobState, now: float) -> int:
    """Remove the straggler once the job has grown past the size it had (the replacement joined)."""
    replacing = state.sizing.replacing
    assert replacing is not None
    straggler = replacing["straggler"]
    if state.member(straggler) is None:
        state.sizing.replacing = None
        return 0
    if state.world_size <= replacing["size"]:
        return 0
    state.sizing.replacing = None
    return _remove_straggler(state, straggler, {"straggler": straggler, "replaced": True}, now)


def _remove_straggler(state: JobState, straggler: str, inputs: dict[str, Any], now: float) -> int:
    if state.world_size <= max(1, state.min_workers):
        state.sizing.note("straggler", "kept", f"{straggler} is a straggler but the job is at its minimum size "
                          f"({state.world_size})", inputs, now)
        state.measured.detector.forget([w for w in state.member_ids if w != straggler])
        return 0
    cause = state.sizing.note("straggler", "remove", f"removing straggler {straggler}", inputs, now)
    leaving.request_leave(state, straggler, now, cause=cause)
    state.measured.detector.forget([w for w in state.member_ids if w != straggler])
    return 0
