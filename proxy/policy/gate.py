"""The release policy applied to one repository (docs/architecture.md, "Release policy").

``ReleaseGate.check(key)`` runs before any answer for a key of a release (a file, its
checksum, its metadata, HEAD, Range or 304 alike): a held or denied version gets 403 with
what, why, which rule and, for a hold, until when. ``judge`` gives an index document its
``View`` (the versions to leave out). Both rest on one decision per (package, version),
kept until a hold ends or the policy is reloaded: a hit costs a dictionary lookup, and no
database read for a decision already known.

The engine applies the policy; formats only describe (``contract.Releases``): which
package and version a key belongs to, where a version's publish time is written, and how
their documents list versions.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.cache.documents import Judged, Listed
from proxy.clock import Clock
from proxy.config.settings import PolicySettings
from proxy.contract import (
    ListedVersion,
    PackageVersion,
    PublishedAt,
    PublishedIn,
    Releases,
    View,
    Withheld,
)
from proxy.exceptions import FetchError, NotFound, ReleaseWithheld
from proxy.http import lane
from proxy.policy import explain
from proxy.policy.decisions import Action, Decision, Policy, PublishTime
from proxy.policy.rules import PackageId, package_id
from proxy.policy.times import LAST_MODIFIED, PublishTimes, ReleaseSource, Times
from proxy.runtime import metrics

log = logging.getLogger("proxy.policy")

DECISIONS_CAPACITY = 100_000  # (package, version) decisions remembered per repository
KEYS_CAPACITY = 100_000  # keys whose package and version are remembered
LOOKUPS_AT_ONCE = 8  # publish-time lookups (Maven poms) of one document in parallel
RETRY_UNKNOWN_S = 60.0  # a decision made without an upstream that failed is redone after


UNLISTED = Decision(
    Action.ALLOW,
    "none",
    "policy",
    "not on its index document, so its format fetches nothing for it; the rules alone "
    "judge a copy already stored",
)


class Policies:
    """The engine's current release policy. A reload (SIGHUP) replaces it as a whole;
    every gate reads ``current`` at each decision, so nothing decided under the old one
    is used again (its generation is over)."""

    def __init__(self, settings: PolicySettings, cooldowns: Mapping[str, float | None]) -> None:
        self.current = Policy(settings, cooldowns)

    def replace(self, settings: PolicySettings, cooldowns: Mapping[str, float | None]) -> Policy:
        self.current = Policy(settings, cooldowns, self.current.generation + 1)
        return self.current


@dataclass(frozen=True, slots=True)
class _Known:
    decision: Decision
    generation: int
    until_ms: int | None  # redo it then (a hold ends, an upstream is asked again)


class ReleaseGate:
    def __init__(
        self,
        repository: str,
        policies: Policies,
        releases: Releases[Any],
        package_of: Callable[[str], PackageVersion | None],
        times: PublishTimes,
        clock: Clock,
    ) -> None:
        self.repository = repository
        self.policies = policies
        self.releases = releases
        self.package_of = package_of
        self.times = times
        self.clock = clock
        self.adapter: Any = None  # the format's adapter, for its Releases questions
        self.source: ReleaseSource | None = None  # the repository's cache
        self._keys: OrderedDict[str, PackageVersion | None] = OrderedDict()
        self._ids: dict[str, PackageId] = {}
        self._decisions: OrderedDict[tuple[str, str], _Known] = OrderedDict()
        self._counters: dict[tuple[str, str], Any] = {}

    def bind(self, adapter: Any, source: ReleaseSource) -> None:
        self.adapter = adapter
        self.source = source

    # -- requests for a key -------------------------------------------------------------

    async def check(self, key: str) -> None:
        """Let the request for ``key`` go on, or refuse it (``ReleaseWithheld``)."""
        policy = self.policies.current
        if not policy.active(self.repository):
            return
        version = self._version_of(key)
        if version is None or version.version is None:
            return  # no release of one version: an index document, a root page
        decision = await self.decision(version, policy)
        counter = self._counter(decision)
        counter.inc()
        lane.note_each_hit(counter.inc)  # every hit the lane answers counts it too
        known = self._decisions.get((version.package, version.version))
        if known is not None:
            lane.note_until(known.until_ms)  # it is made again then, and may differ
        if decision.allowed or policy.report_only:
            return
        purl = self.purl(version.package)
        raise ReleaseWithheld(
            explain.refusal(decision, f"{purl}@{version.version}", key),
            explain.problem(decision, purl, version.version, key, f"/{self.repository}/{key}"),
        )

    def _version_of(self, key: str) -> PackageVersion | None:
        known = self._keys.get(key, False)
        if known is not False:
            assert known is None or isinstance(known, PackageVersion)
            return known
        found = self.package_of(key)
        self._keys[key] = found
        if len(self._keys) > KEYS_CAPACITY:
            self._keys.popitem(last=False)
        return found

    def purl(self, package: str) -> str:
        return str(self.releases.purl(package))

    def _package_id(self, package: str) -> PackageId:
        found = self._ids.get(package)
        if found is None:
            ref = self.releases.purl(package)
            found = self._ids[package] = package_id(ref.type, ref.namespace, ref.name)
        return found

    def count(self, decision: Decision) -> None:
        self._counter(decision).inc()

    async def of_key(self, key: str) -> tuple[PackageVersion, Decision] | None:
        """The release ``key`` belongs to and the decision on it (None: the key is of no
        release of one version), without counting or refusing anything: what the
        operators' console shows of an entry."""
        version = self._version_of(key)
        if version is None or version.version is None:
            return None
        return version, await self.decision(version)

    async def explain(self, package: str, version: str | None) -> list[tuple[str, Decision]]:
        """The decision on one version of ``package``, or on every version its index
        document lists (``proxy policy explain``); fetches through the cache what it
        needs, like any request. ``NotFound`` if the upstream has no such package."""
        if version is not None:
            return [(version, await self.decision(PackageVersion(package, version)))]
        assert self.source is not None
        spec = self.releases.index(self.adapter, package)
        listed = await self.source.listed(spec)
        if listed is None:
            raise NotFound(f"{self.purl(package)}: the upstream has no {spec.key}")
        policy = self.policies.current
        versions = listed.versions()
        decisions = await self._decide_listed(
            policy, package, self._package_id(package), listed, versions
        )
        return [(v.version, d) for v, d in zip(versions, decisions, strict=True)]

    # -- decisions -----------------------------------------------------------------------

    async def decision(self, version: PackageVersion, policy: Policy | None = None) -> Decision:
        """The decision on one version, kept until a hold ends or the policy changes."""
        policy = policy or self.policies.current
        assert version.version is not None
        ident = (version.package, version.version)
        now_ms = self.clock.now_ms()
        known = self._decisions.get(ident)
        if (
            known is not None
            and known.generation == policy.generation
            and (known.until_ms is None or now_ms < known.until_ms)
        ):
            return known.decision
        package = self._package_id(version.package)
        times = Times()
        if policy.needs_time(self.repository, package, version.version):
            times = await self._times(version)
        return self._decided(policy, version, package, times)

    def _decided(
        self, policy: Policy, version: PackageVersion, package: PackageId, times: Times
    ) -> Decision:
        assert version.version is not None
        now_ms = self.clock.now_ms()
        if times.unlisted:
            decision = UNLISTED
        else:
            decision = policy.decide(
                self.repository,
                package,
                version.version,
                times.published,
                times.first_seen_ms,
                now_ms,
            )
        until_ms = decision.available_at_ms
        if not times.durable:
            until_ms = now_ms + int(RETRY_UNKNOWN_S * 1000)
        self._decisions[(version.package, version.version)] = _Known(
            decision, policy.generation, until_ms
        )
        if len(self._decisions) > DECISIONS_CAPACITY:
            self._decisions.popitem(last=False)
        if not decision.allowed:
            log.info(
                "release policy%s: repository=%s %s@%s %s: %s",
                " (report mode, served anyway)" if policy.report_only else "",
                self.repository,
                self.purl(version.package),
                version.version,
                explain.verdict(decision),
                decision.reason,
            )
        return decision

    async def _times(self, version: PackageVersion) -> Times:
        """When a version was published, where its format says to look."""
        assert self.source is not None and version.version is not None
        published = self.releases.published(self.adapter, version)
        try:
            if isinstance(published, PublishedAt):
                return await self.times.last_modified(self.source, published.spec)
            assert isinstance(published, PublishedIn)
            listed = await self.source.listed(published.spec)
            found = listed.version(version.version) if listed is not None else None
            if found is None and listed is not None:
                listed = await self.source.listed(published.spec, refresh=True)
                found = listed.version(version.version) if listed is not None else None
            if found is None or listed is None:
                return Times(unlisted=True)
            return self.times.listed(listed, found)
        except FetchError as exc:
            log.warning(
                "release policy: repository=%s: no publish time for %s@%s (%s); judged as "
                "unknown for now",
                self.repository,
                self.purl(version.package),
                version.version,
                exc,
            )
            return Times(durable=False)

    # -- index documents -------------------------------------------------------------------

    async def judge(self, key: str, listed: Listed) -> Judged:
        """The ``View`` of an index document: the versions it must leave out (none in
        report mode, where they are only counted), quarantine when every version is
        denied (the first sights of files it gives no time for are added where it is
        rendered, from the catalog's text)."""
        policy = self.policies.current
        generation = policy.generation
        if not policy.active(self.repository):
            return Judged(View(), "", generation=generation)
        owner = self._version_of(key)
        if owner is None:
            return Judged(View(), "", generation=generation)
        package = self._package_id(owner.package)
        versions = listed.versions()
        decisions = await self._decide_listed(policy, owner.package, package, listed, versions)
        withheld = {
            v.version: Withheld(
                "hold" if d.action is Action.HOLD else "deny", d.reason, d.available_at_ms
            )
            for v, d in zip(versions, decisions, strict=True)
            if not d.allowed
        }
        # Worked out again when the first of its decisions may change: a hold ends, or
        # an upstream that could not be asked is asked again.
        redo = [self._decisions.get((owner.package, v.version)) for v in versions]
        ends = [k.until_ms for k in redo if k is not None and k.until_ms is not None]
        until_ms = min(ends) if ends else None
        counted = [self._counter(d) for d in decisions if not d.allowed]

        def count(n: int) -> None:
            for counter in counted:
                counter.inc(n)

        if policy.report_only:
            return Judged(View(), "", until_ms, generation, count)
        quarantined = None
        if decisions and all(d.action is Action.DENY for d in decisions):
            reasons = list(dict.fromkeys(d.reason for d in decisions))
            quarantined = "; ".join(reasons)
        identity = ";".join(f"{v}={w.action}" for v, w in sorted(withheld.items()))
        if quarantined is not None:
            identity = "quarantined"
        view = View(withheld, quarantined, self._learnt(owner.package, versions, decisions))
        return Judged(view, identity, until_ms, generation, count)

    def _learnt(
        self, owner: str, versions: list[ListedVersion], decisions: list[Decision]
    ) -> dict[str, int]:
        """The publish times learnt elsewhere than the document (a Maven pom's
        Last-Modified), by the key they were read from: a rendering that leaves
        versions out shows the newest time of those left (Maven's ``lastUpdated``)."""
        learnt = {}
        for listed, decision in zip(versions, decisions, strict=True):
            published = decision.published
            if published is None or published.source != LAST_MODIFIED:
                continue
            where = self.releases.published(self.adapter, PackageVersion(owner, listed.version))
            learnt[where.spec.key] = published.at_ms
        return learnt

    def _counter(self, decision: Decision) -> Any:
        label = (decision.action.value, decision.rule)
        counter = self._counters.get(label)
        if counter is None:
            counter = metrics.POLICY_DECISIONS.labels(self.repository, *label)
            self._counters[label] = counter
        return counter

    async def _decide_listed(
        self,
        policy: Policy,
        owner: str,
        package: PackageId,
        listed: Listed,
        versions: list[ListedVersion],
    ) -> list[Decision]:
        """One decision per listed version: from what the document says, else (for a
        format whose versions' times are elsewhere, Maven's poms) asked for, a few at a
        time; a document that states a time no version is newer than (Maven's
        ``lastUpdated``) spares every lookup it settles."""
        now_ms = self.clock.now_ms()
        generation = policy.generation
        bound = listed.updated_at_ms
        results: list[Decision | None] = []
        pending: list[int] = []
        for i, listed_version in enumerate(versions):
            ident = (owner, listed_version.version)
            known = self._decisions.get(ident)
            if (
                known is not None
                and known.generation == generation
                and (known.until_ms is None or now_ms < known.until_ms)
            ):
                results.append(known.decision)
                continue
            version = PackageVersion(owner, listed_version.version)
            if not policy.needs_time(self.repository, package, listed_version.version):
                results.append(self._decided(policy, version, package, Times()))
                continue
            times = PublishTimes.listed(listed, listed_version)
            if times.published is None and bound is not None:
                at_most = PublishTime(bound, "lastUpdated, at the latest")
                if policy.decide(
                    self.repository, package, listed_version.version, at_most, None, now_ms
                ).allowed:
                    times = Times(at_most)
            if times.published is None and self._elsewhere(version):
                results.append(None)
                pending.append(i)
                continue
            results.append(self._decided(policy, version, package, times))
        if pending:
            slots = asyncio.Semaphore(LOOKUPS_AT_ONCE)

            async def one(i: int) -> None:
                version = PackageVersion(owner, versions[i].version)
                async with slots:
                    times = await self._times(version)
                if times.published is None and times.first_seen_ms is None:
                    times = Times(
                        first_seen_ms=listed.first_seen_of(versions[i]), durable=times.durable
                    )
                results[i] = self._decided(policy, version, package, times)

            await asyncio.gather(*(one(i) for i in pending))
        return [d for d in results if d is not None]

    def _elsewhere(self, version: PackageVersion) -> bool:
        """Is the version's publish time written somewhere other than its document?"""
        return isinstance(self.releases.published(self.adapter, version), PublishedAt)
