"""The release policy's pure parts: rules (proxy/policy/rules.py), decisions
(proxy/policy/decisions.py), their words (proxy/policy/explain.py) and the [policy]
settings with errors that name the key (proxy/config/load.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config.load import load
from proxy.config.settings import PolicyRule, PolicySettings
from proxy.exceptions import ConfigError
from proxy.policy import explain
from proxy.policy.decisions import Action, Policy, PublishTime
from proxy.policy.rules import Rules, package_id, parse_match, parse_versions
from tests.conftest import write_config

NOW_MS = 1_800_000_000_000
DAY_MS = 86_400_000


def rule(index: int, match: str, **fields: object) -> PolicyRule:
    return PolicyRule(index=index, match=match, **fields)  # type: ignore[arg-type]


# -- rules -----------------------------------------------------------------------------


def test_rules_match_a_package_by_its_normalized_purl() -> None:
    rules = Rules([rule(0, "pkg:pypi/Django_Rest.Framework", action="deny")])
    assert rules.first(package_id("pypi", None, "django-rest-framework"), "1.0") is not None
    assert rules.first(package_id("pypi", None, "Django.REST_framework"), "1.0") is not None
    assert rules.first(package_id("pypi", None, "django"), "1.0") is None
    maven = Rules([rule(0, "pkg:maven/org.example/lib", action="deny")])
    assert maven.first(package_id("maven", "org.example", "lib"), "1.0") is not None
    assert maven.first(package_id("maven", "org.other", "lib"), "1.0") is None
    npm = Rules([rule(0, "pkg:npm/%40scope/name", action="deny")])
    assert npm.first(package_id("npm", "@scope", "name"), "1.0.0") is not None


@pytest.mark.parametrize(
    ("scheme", "versions", "inside", "outside"),
    [
        ("pypi", "vers:pypi/>=1.2|<1.3", ["1.2", "1.2.9", "1.2.post1"], ["1.3", "1.1", "1.2rc1"]),
        ("maven", "vers:maven/>=1.0|<2.0", ["1.0", "1.9.9"], ["2.0", "0.9", "1.0-SNAPSHOT"]),
        ("npm", "vers:npm/>=1.2.0|<2.0.0", ["1.2.0", "1.9.0", "2.0.0-rc.1"], ["2.0.0", "1.1.9"]),
    ],
)
def test_version_ranges_follow_each_ecosystems_order(
    scheme: str, versions: str, inside: list[str], outside: list[str]
) -> None:
    match = {"pypi": "pkg:pypi/a", "maven": "pkg:maven/g/a", "npm": "pkg:npm/a"}[scheme]
    package, _ = parse_match(match)
    rules = Rules([rule(0, match, versions=versions, action="deny")])
    for version in inside:
        assert rules.first(package, version) is not None, version
    for version in [*outside, "not a version!"]:
        assert rules.first(package, version) is None, version


def test_the_first_matching_rule_wins() -> None:
    rules = Rules(
        [
            rule(0, "pkg:pypi/a", versions="vers:pypi/>=2", action="deny"),
            rule(1, "pkg:pypi/a", cooldown_s=0.0),
        ]
    )
    package = package_id("pypi", None, "a")
    first, second = rules.first(package, "2.1"), rules.first(package, "1.0")
    assert first is not None and first.index == 0
    assert second is not None and second.index == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pkg:pypi/a@1.0", "names a version"),
        ("pkg:pypi/a?x=1", "qualifiers"),
        ("requests", "is not a package URL"),
    ],
)
def test_a_match_is_a_purl_of_a_package(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_match(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vers:pypi/>=1.2|<", "is not a version range"),
        ("vers:maven/>=1", "orders versions as 'maven'"),
        (">=1.2", "is not a version range"),
        ("vers:pypi/>=not-a-version", "is not a version range"),
    ],
)
def test_versions_is_a_vers_range_of_the_purls_type(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_versions(text, "pypi")


# -- decisions --------------------------------------------------------------------------

A = package_id("pypi", None, "a")


def policy(**settings: object) -> Policy:
    return Policy(PolicySettings(**settings), {"pypi": None, "strict": 7 * 86400.0})  # type: ignore[arg-type]


def published(days_ago: float) -> PublishTime:
    return PublishTime(NOW_MS - int(days_ago * DAY_MS), "upload-time")


def test_a_cooldown_holds_a_version_until_it_is_old_enough() -> None:
    p = policy(cooldown_s=3 * 86400.0)
    held = p.decide("pypi", A, "2.0", published(1), None, NOW_MS)
    assert held.action is Action.HOLD and held.available_at_ms == NOW_MS + 2 * DAY_MS
    assert (held.rule, held.setting) == ("cooldown", "policy.cooldown")
    assert held.published == published(1)
    assert p.decide("pypi", A, "1.0", published(4), None, NOW_MS).allowed
    # A repository's own cooldown wins over [policy].cooldown.
    strict = p.decide("strict", A, "1.0", published(4), None, NOW_MS)
    assert strict.action is Action.HOLD and strict.setting == "repositories.strict.cooldown"


def test_no_policy_allows_everything_without_asking_when_it_was_published() -> None:
    p = policy()
    assert not p.active("pypi") and not p.needs_time("pypi", A, "1.0")
    assert p.decide("pypi", A, "1.0", None, None, NOW_MS).allowed


def test_rules_deny_allow_or_change_the_cooldown() -> None:
    p = policy(
        cooldown_s=3 * 86400.0,
        rules=(
            rule(0, "pkg:pypi/a", versions="vers:pypi/>=3", action="deny", reason="INC-1"),
            rule(1, "pkg:pypi/a", versions="vers:pypi/>=2", action="allow", name="exempt"),
            rule(2, "pkg:pypi/a", cooldown_s=10 * 86400.0),
        ),
    )
    denied = p.decide("pypi", A, "3.0", published(100), None, NOW_MS)
    assert (denied.action, denied.reason, denied.rule) == (Action.DENY, "INC-1", "0")
    assert not p.needs_time("pypi", A, "3.0")  # decided by the rule alone
    allowed = p.decide("pypi", A, "2.0", published(0), None, NOW_MS)
    assert allowed.allowed and allowed.rule == "exempt"
    longer = p.decide("pypi", A, "1.0", published(5), None, NOW_MS)
    assert longer.action is Action.HOLD and longer.setting == "policy.rules[2]"


def test_exclude_newer_denies_what_came_after_it() -> None:
    p = policy(exclude_newer_ms=NOW_MS - 10 * DAY_MS)
    late = p.decide("pypi", A, "2.0", published(5), None, NOW_MS)
    assert late.action is Action.DENY and late.setting == "policy.exclude_newer"
    assert p.decide("pypi", A, "1.0", published(20), None, NOW_MS).allowed


def test_an_unknown_publish_time_is_first_seen_allowed_or_denied() -> None:
    first_seen = policy(cooldown_s=86400.0)
    held = first_seen.decide("pypi", A, "1.0", None, NOW_MS - 1000, NOW_MS)
    assert held.action is Action.HOLD and held.published is not None
    assert held.published.source == "first-seen"
    assert first_seen.decide("pypi", A, "1.0", None, NOW_MS - 2 * DAY_MS, NOW_MS).allowed
    allow = policy(cooldown_s=86400.0, unknown_publish_time="allow")
    assert allow.decide("pypi", A, "1.0", None, NOW_MS, NOW_MS).allowed
    deny = policy(cooldown_s=86400.0, unknown_publish_time="deny")
    refused = deny.decide("pypi", A, "1.0", None, NOW_MS, NOW_MS)
    assert refused.action is Action.DENY and refused.rule == "unknown_publish_time"


def test_a_refusal_in_words_and_as_a_problem_document() -> None:
    held = policy(cooldown_s=3 * 86400.0).decide("pypi", A, "2.0", published(1), None, NOW_MS)
    text = explain.refusal(held, "pkg:pypi/a@2.0", "files/a/a-2.0.tar.gz")
    assert text.startswith("files/a/a-2.0.tar.gz: pkg:pypi/a@2.0 is held back until 2027-")
    assert "by the release policy (policy.cooldown)" in text
    document = explain.problem(held, "pkg:pypi/a", "2.0", "files/a/a-2.0.tar.gz", "/pypi/x")
    assert document["status"] == 403 and document["detail"] == text
    assert document["available_at"].startswith("2027-")


# -- settings ---------------------------------------------------------------------------


def config_errors(tmp_path: Path, body: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(write_config(tmp_path, body), {})
    return caught.value.errors


def test_policy_settings_load(tmp_path: Path) -> None:
    settings = load(
        write_config(
            tmp_path,
            """
            [policy]
            cooldown = "3d"
            mode = "report"
            unknown_publish_time = "deny"
            exclude_newer = 2026-11-01T00:00:00Z
            [[policy.rules]]
            match = "pkg:pypi/Requests"
            cooldown = "0"
            [[policy.rules]]
            match = "pkg:pypi/evil-pkg"
            versions = "vers:pypi/>=1.2|<1.3"
            action = "deny"
            reason = "compromised release, see INC-123"
            name = "inc-123"
            [[repositories]]
            name = "pypi"
            format = "pypi"
            cooldown = "7d"
            """,
        ),
        {},
    )
    p = settings.policy
    assert (p.cooldown_s, p.mode, p.unknown_publish_time) == (3 * 86400, "report", "deny")
    assert p.exclude_newer_ms == 1793491200000
    assert p.rules[0].match == "pkg:pypi/requests" and p.rules[0].cooldown_s == 0
    assert p.rules[1].label == "inc-123" and p.rules[1].versions == "vers:pypi/>=1.2|<1.3"
    assert settings.repositories[0].cooldown_s == 7 * 86400
    described = settings.describe()
    assert 'exclude_newer = "2026-11-01T00:00:00Z"' in described
    assert 'versions = "vers:pypi/>=1.2|<1.3"' in described
    assert 'cooldown = "7d"' in described
    # check-config's output loads again to the same settings.
    again = load(write_config(tmp_path, described, "again.toml"), {})
    assert again.policy == settings.policy


def test_policy_errors_name_the_key(tmp_path: Path) -> None:
    errors = config_errors(
        tmp_path,
        """
        [policy]
        cooldown = "3 days"
        mode = "warn"
        unknown_publish_time = "never"
        exclude_newer = "2026-11-01"
        colour = "blue"
        [[policy.rules]]
        match = "pkg:gem/rails"
        action = "deny"
        [[policy.rules]]
        match = "pkg:pypi/evil-pkg"
        versions = "vers:pypi/>=1.2|<"
        action = "block"
        [[policy.rules]]
        match = "pkg:pypi/a"
        action = "deny"
        cooldown = "1d"
        name = "bad name!"
        [[policy.rules]]
        match = "pkg:pypi/b"
        [[policy.rules]]
        versions = "vers:pypi/1"
        action = "deny"
        [[repositories]]
        name = "raw"
        format = "raw"
        upstream = "https://upstream.example/raw/"
        cooldown = "1d"
        """,
    )
    expected = [
        "policy.colour: unknown key",
        "policy.rules[0].match: 'pkg:gem/rails': the policy judges no 'gem' packages",
        "policy.rules[1].versions: 'vers:pypi/>=1.2|<' is not a version range",
        "policy.rules[1].action: 'block' is not one of allow, deny",
        "policy.rules[2].name: 'bad name!' is not a rule name",
        'policy.rules[2].cooldown: a rule with action = "deny" has no cooldown',
        'policy.rules[3]: needs an action ("allow" or "deny") or a cooldown',
        "policy.rules[4].match: is required",
        "policy.cooldown: '3 days' is not a duration",
        "policy.mode: 'warn' is not one of enforce, report",
        "policy.unknown_publish_time: 'never' is not one of first-seen, allow, deny",
        "policy.exclude_newer: '2026-11-01' is not a date and time with its offset",
        "repositories.raw.cooldown: unknown key for format 'raw'",
    ]
    for start in expected:
        assert any(e.startswith(start) for e in errors), (start, errors)


def test_rule_names_are_unique(tmp_path: Path) -> None:
    errors = config_errors(
        tmp_path,
        """
        [[policy.rules]]
        match = "pkg:pypi/a"
        action = "deny"
        name = "x"
        [[policy.rules]]
        match = "pkg:pypi/b"
        action = "deny"
        name = "x"
        """,
    )
    assert errors == ["policy.rules[1].name: 'x' is also the name of policy.rules[0]"]
