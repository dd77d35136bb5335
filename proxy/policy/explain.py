"""A decision in words: the 403 answer's message, its RFC 9457 problem document, and
what ``proxy policy explain`` prints. The same facts every time: what, why, which rule
and, for a hold, when the version becomes available."""

from __future__ import annotations

from typing import Any

from proxy.policy.decisions import Action, Decision
from proxy.units import format_timestamp

PROBLEM_TYPES = {
    Action.HOLD: "urn:artifact-proxy:release-policy:held",
    Action.DENY: "urn:artifact-proxy:release-policy:denied",
}
TITLES = {
    Action.ALLOW: "Allowed by the release policy",
    Action.HOLD: "Held back by the release policy",
    Action.DENY: "Denied by the release policy",
}


def verdict(decision: Decision) -> str:
    """``allowed``, ``held back until <time>`` or ``denied``."""
    if decision.action is Action.HOLD and decision.available_at_ms is not None:
        return f"held back until {format_timestamp(decision.available_at_ms)}"
    return {Action.ALLOW: "allowed", Action.HOLD: "held back", Action.DENY: "denied"}[
        decision.action
    ]


def sentence(decision: Decision, release: str) -> str:
    """``pkg:pypi/demo@2.0 is held back until ... by the release policy (policy.cooldown):
    published ...``."""
    return f"{release} is {verdict(decision)} by the release policy ({decision.setting}): " + (
        decision.reason
    )


def refusal(decision: Decision, release: str, key: str) -> str:
    """The 403 answer's message for a request of ``key``."""
    text = f"{key}: {sentence(decision, release)}"
    if decision.action is Action.HOLD:
        text += "; ask again then, or have an operator add an exemption ([[policy.rules]])"
    return text


def facts(decision: Decision, package: str, version: str | None) -> dict[str, Any]:
    """The decision as JSON-ready fields (problem documents, ``explain --json``)."""
    found: dict[str, Any] = {
        "package": package,
        "version": version,
        "action": decision.action.value,
        "rule": decision.rule,
        "setting": decision.setting,
        "reason": decision.reason,
    }
    if decision.published is not None:
        found["published_at"] = format_timestamp(decision.published.at_ms)
        found["published_from"] = decision.published.source
    if decision.available_at_ms is not None:
        found["available_at"] = format_timestamp(decision.available_at_ms)
    return found


def problem(
    decision: Decision, package: str, version: str | None, key: str, instance: str
) -> dict[str, Any]:
    """The RFC 9457 problem document of a refusal: ``type``, ``title``, ``status``,
    ``detail`` and ``instance``, then the decision's own fields (extension members)."""
    release = f"{package}@{version}" if version else package
    return {
        "type": PROBLEM_TYPES.get(decision.action, "about:blank"),
        "title": TITLES[decision.action],
        "status": 403,
        "detail": refusal(decision, release, key),
        "instance": instance,
        **facts(decision, package, version),
    }
