"""One decision per (repository, package, version): allowed, held until a time, or
denied, and why (docs/architecture.md, "Release policy").

``Policy.decide`` is a pure function of the settings, the version's publish time and
the time now (the engine's ``Clock``): the same question asked twice gets the same
answer until a hold ends or the policy is reloaded, so callers may keep answers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.config.settings import PolicyRule, PolicySettings
from proxy.policy.rules import PackageId, Rules
from proxy.units import format_duration, format_timestamp

FIRST_SEEN = "first-seen"  # the publish time's source when the upstream states none


class Action(enum.StrEnum):
    ALLOW = "allow"
    HOLD = "hold"  # until ``Decision.available_at_ms``
    DENY = "deny"


@dataclass(frozen=True, slots=True)
class PublishTime:
    """When a version was published, and where that was read: the index's own field
    (``upload-time``, npm's ``time``), the upstream's ``Last-Modified``, or ``first-seen``
    (when this fleet first saw it listed)."""

    at_ms: int
    source: str


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    # Bounded metric label: a rule's name or index, or which setting decided
    # ("cooldown", "exclude_newer", "unknown_publish_time"), or "none".
    rule: str
    setting: str  # the key that decided, e.g. "policy.rules[1]", "repositories.pypi.cooldown"
    reason: str  # why, in words
    published: PublishTime | None = None
    available_at_ms: int | None = None  # a hold ends then

    @property
    def allowed(self) -> bool:
        return self.action is Action.ALLOW


ALLOWED = Decision(Action.ALLOW, "none", "policy", "no rule or cooldown applies")


class Policy:
    """``[policy]`` and every repository's ``cooldown``, compiled once."""

    def __init__(
        self, settings: PolicySettings, cooldowns: Mapping[str, float | None], generation: int = 0
    ) -> None:
        self.settings = settings
        self.rules = Rules(settings.rules)
        self.generation = generation  # bumped at each reload: answers kept before are void
        self._cooldowns = {
            repository: (
                (seconds, f"repositories.{repository}.cooldown")
                if seconds is not None
                else (settings.cooldown_s, "policy.cooldown")
            )
            for repository, seconds in cooldowns.items()
        }

    @property
    def report_only(self) -> bool:
        """Report mode: decide, log and count, but withhold nothing."""
        return self.settings.mode == "report"

    def cooldown(self, repository: str) -> tuple[float, str]:
        """The repository's cooldown and the key that sets it."""
        return self._cooldowns.get(repository, (self.settings.cooldown_s, "policy.cooldown"))

    def active(self, repository: str) -> bool:
        """Could anything be withheld in ``repository``? If not, nothing is asked."""
        return bool(
            self.rules or self.cooldown(repository)[0] > 0 or self.settings.exclude_newer_ms
        )

    def needs_time(self, repository: str, package: PackageId, version: str | None) -> bool:
        """Does the decision depend on when the version was published?"""
        rule = self.rules.first(package, version)
        if rule is not None and rule.action is not None:
            return False
        return self._time_limits(repository, rule)[0] > 0 or (
            self.settings.exclude_newer_ms is not None
        )

    def _time_limits(self, repository: str, rule: PolicyRule | None) -> tuple[float, str, str]:
        """(cooldown seconds, the key that sets it, its metric label)."""
        if rule is not None and rule.cooldown_s is not None:
            return rule.cooldown_s, rule.key, rule.label
        seconds, setting = self.cooldown(repository)
        return seconds, setting, "cooldown"

    def decide(
        self,
        repository: str,
        package: PackageId,
        version: str | None,
        published: PublishTime | None,
        first_seen_ms: int | None,
        now_ms: int,
    ) -> Decision:
        """The decision on one version. ``published``: the time the upstream states, if
        any; ``first_seen_ms``: when this fleet first saw the version listed (used when
        the upstream states none and ``unknown_publish_time`` is "first-seen"; None is
        taken as now)."""
        rule = self.rules.first(package, version)
        if rule is not None and rule.action == "deny":
            why = rule.reason or f"denied by {rule.key} ({rule.match}"
            if rule.reason is None:
                why += f" {rule.versions})" if rule.versions else ", every version)"
            return Decision(Action.DENY, rule.label, rule.key, why)
        if rule is not None and rule.action == "allow":
            why = rule.reason or f"allowed by {rule.key}, whatever its publish time"
            return Decision(Action.ALLOW, rule.label, rule.key, why)
        cooldown_s, cooldown_key, cooldown_label = self._time_limits(repository, rule)
        exclude_newer_ms = self.settings.exclude_newer_ms
        label = rule.label if rule is not None else "none"
        if cooldown_s <= 0 and exclude_newer_ms is None:
            why = f"no cooldown applies ({cooldown_key} is 0)"
            return Decision(Action.ALLOW, label, cooldown_key, why, published)
        if published is None:
            unknown = self.settings.unknown_publish_time
            setting = "policy.unknown_publish_time"
            if unknown == "allow":
                why = f'the upstream states no publish time, and {setting} is "allow"'
                return Decision(Action.ALLOW, "unknown_publish_time", setting, why)
            if unknown == "deny":
                why = f'the upstream states no publish time, and {setting} is "deny"'
                return Decision(Action.DENY, "unknown_publish_time", setting, why)
            published = PublishTime(now_ms if first_seen_ms is None else first_seen_ms, FIRST_SEEN)
        when = f"published {format_timestamp(published.at_ms)} ({published.source})"
        if exclude_newer_ms is not None and published.at_ms > exclude_newer_ms:
            why = f"{when}, after policy.exclude_newer ({format_timestamp(exclude_newer_ms)})"
            return Decision(Action.DENY, "exclude_newer", "policy.exclude_newer", why, published)
        if cooldown_s > 0:
            available_ms = published.at_ms + int(cooldown_s * 1000)
            if available_ms > now_ms:
                why = (
                    f"{when}; the cooldown of {format_duration(cooldown_s)} ({cooldown_key}) "
                    f"holds it until {format_timestamp(available_ms)}"
                )
                return Decision(
                    Action.HOLD, cooldown_label, cooldown_key, why, published, available_ms
                )
            why = f"{when}, longer ago than the cooldown of {format_duration(cooldown_s)}"
            return Decision(Action.ALLOW, label, cooldown_key, why, published)
        why = f"{when}, before policy.exclude_newer ({format_timestamp(exclude_newer_ms or 0)})"
        return Decision(Action.ALLOW, label, "policy.exclude_newer", why, published)
