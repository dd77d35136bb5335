"""The OpenAPI 3.1 document of the admin API, served at ``/api/v1/openapi.json``.

Written by hand next to the routes (``admin/api.py``); ``tests/test_admin_api.py``
checks that every route is described and every described path answers.
"""

from __future__ import annotations

import functools
from typing import Any

from proxy import __version__

JSON = "application/json"


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


_INT = {"type": "integer"}
_STR = {"type": "string"}
_NUM = {"type": "number"}
_NULL_INT = {"type": ["integer", "null"]}
_NULL_STR = {"type": ["string", "null"]}
_NULL_NUM = {"type": ["number", "null"]}

SCHEMAS: dict[str, Any] = {
    "Error": _object({"error": _STR}, ["error"]),
    "Repository": _object(
        {
            "name": _STR, "format": _STR, "entries": _INT, "bytes": _INT,
            "max_size": _NULL_INT, "hits": _INT, "misses": _INT, "hit_ratio": _NULL_NUM,
            "upstreams": {"type": "array", "items": _STR}, "configured": {"type": "boolean"},
            "packages": {"type": "boolean"},
        },
        ["name", "format", "entries", "bytes", "hits", "misses"],
    ),
    "Replica": _object(
        {
            "holder": _STR, "host": _STR, "pid": _INT, "url": _STR, "version": _STR,
            "started_ms": _INT, "seen_ms": _INT, "seen_s_ago": _NUM,
            "alive": {"type": "boolean"},
        },
        ["holder", "alive"],
    ),
    "Replicas": _object(
        {"replicas": {"type": "array", "items": {"$ref": "#/components/schemas/Replica"}}},
        ["replicas"],
    ),
    "Stats": _object(
        {
            "repositories": {"type": "array", "items": {"$ref": "#/components/schemas/Repository"}},
            "database": {"type": "object"},
            "storage": {"type": "object"},
            "replicas": {"type": "array", "items": {"$ref": "#/components/schemas/Replica"}},
            "upstreams": {"type": "array", "items": {"type": "object"}},
        },
        ["repositories", "database", "storage", "replicas", "upstreams"],
    ),
    "InFlight": _object(
        {
            "key": _STR, "holder": _STR, "fence": _INT, "started_ms": _INT, "age_s": _NUM,
            "bytes": _NULL_INT, "length": _NULL_INT, "rate": _NULL_NUM, "waiters": _NULL_INT,
        },
        ["key", "holder"],
    ),
    "InFlightList": _object(
        {"in_flight": {"type": "array", "items": {"$ref": "#/components/schemas/InFlight"}}},
        ["in_flight"],
    ),
    "Entry": _object(
        {
            "key": _STR, "kind": _STR, "size": _NULL_INT, "package": _NULL_STR,
            "version": _NULL_STR, "fetched_at_ms": _INT, "last_access_ms": _INT,
        },
        ["key", "kind"],
    ),
    "EntryPage": _object(
        {
            "repository": _STR, "q": _STR,
            "entries": {"type": "array", "items": {"$ref": "#/components/schemas/Entry"}},
            "next": _NULL_STR,
        },
        ["entries", "next"],
    ),
    "EntryDetail": _object(
        {
            "repository": _STR, "key": _STR, "kind": _STR, "size": _INT,
            "content_type": _NULL_STR, "sha256": _NULL_STR, "digests": {"type": "object"},
            "package": _NULL_STR, "version": _NULL_STR, "upstream_url": _NULL_STR,
            "fetched_at_ms": _INT, "expires_at_ms": _NULL_INT, "last_access_ms": _INT,
            "policy": {"type": ["object", "null"]},
        },
        ["repository", "key", "kind"],
    ),
    "PackagePage": _object(
        {
            "repository": _STR, "q": _STR,
            "packages": {"type": "array", "items": _object(
                {"package": _STR, "entries": _INT, "versions": _INT, "bytes": _INT,
                 "last_access_ms": _INT})},
            "next": _NULL_STR,
        },
        ["packages", "next"],
    ),
    "Package": _object(
        {
            "repository": _STR, "package": _STR, "entries": _INT, "bytes": _INT,
            "versions": {"type": "array", "items": _object(
                {"version": _NULL_STR, "entries": {"type": "array", "items": {
                    "$ref": "#/components/schemas/Entry"}}})},
        },
        ["repository", "package", "versions"],
    ),
    "Purged": _object(
        {"repository": _STR, "package": _STR, "key": _STR, "deleted": _INT, "bytes": _INT},
        ["deleted"],
    ),
    "Jobs": _object(
        {
            "now_ms": _INT,
            "jobs": {"type": "array", "items": _object(
                {"name": _STR, "interval_s": _NULL_NUM, "last_started_ms": _NULL_INT,
                 "last_finished_ms": _NULL_INT, "last_outcome": _NULL_STR,
                 "holder": _NULL_STR, "next_due_ms": _NULL_INT})},
            "failures": {"type": "array", "items": _object(
                {"name": _STR, "run_id": _INT, "holder": _STR, "at_ms": _INT, "reason": _STR})},
            "mirror_runs": {"type": "array", "items": {"$ref": "#/components/schemas/MirrorRun"}},
        },
        ["jobs", "failures", "mirror_runs"],
    ),
    "MirrorRequest": _object(
        {
            "purls": {"type": "array", "items": _STR, "examples": [["pkg:pypi/requests@2.32.3"]]},
            "sbom": {"type": "object", "description": "a CycloneDX or SPDX JSON document"},
            "versions": {"enum": ["latest", "all"]},
            "repository": _STR,
        }
    ),
    "MirrorRun": _object(
        {
            "id": _INT, "name": _STR, "origin": {"enum": ["schedule", "cli", "api"]},
            "holder": _STR, "request": {"type": "object"},
            "state": {"enum": ["running", "ok", "failed", "cancelled", "interrupted"]},
            "cancel_requested": {"type": "boolean"}, "planned": _INT, "fetched": _INT,
            "cached": _INT, "missing": _INT, "failed": _INT, "skipped": _INT, "bytes": _INT,
            "started_ms": _INT, "updated_ms": _INT, "finished_ms": _NULL_INT,
            "error": _NULL_STR,
        },
        ["id", "state"],
    ),
    "MirrorRunStarted": _object({"id": _INT, "state": _STR, "url": _STR}, ["id", "url"]),
}  # fmt: skip


def _ok(schema: str, status: str = "200", description: str = "OK") -> dict[str, Any]:
    return {
        status: {
            "description": description,
            "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
        }
    }


def _errors(*statuses: str) -> dict[str, Any]:
    reasons = {
        "400": "bad input (the message says which)",
        "401": "credentials needed or wrong",
        "403": "no admin user configured (admin.users), or a cross-site request",
        "404": "no such repository, entry, package or run",
        "409": "the run is not running, or the entry is being downloaded",
        "413": "the body is over 16 MiB",
        "415": "a write with Basic credentials must be JSON",
        "429": "too many wrong passwords: see Retry-After",
    }
    error = {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {
        s: {"description": reasons[s], "content": error} for s in ("401", "403", "429", *statuses)
    }


def _query(name: str, description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "description": description,
            "schema": {"type": "string"}}  # fmt: skip


def _path(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string"}}  # fmt: skip


_PAGE = [
    _query("repository", "a configured repository", required=True),
    _query("q", "only packages whose name starts with this"),
    _query("after", "the `next` cursor of the page before"),
    _query("limit", "rows per page, 1 to 500 (default 50)"),
]


@functools.cache
def openapi_document() -> dict[str, Any]:
    repository = _path("repository", "a configured repository")
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "artifact-proxy admin API",
            "version": __version__,
            "description": "What is cached, downloading and failing across the fleet, and "
            "purges and mirror runs. HTTP Basic (an [admin.users] user) or a Bearer token.",
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {
                "basic": {"type": "http", "scheme": "basic"},
                "bearer": {"type": "http", "scheme": "bearer"},
            },
        },
        "security": [{"basic": []}, {"bearer": []}],
        "paths": {
            "/api/v1/openapi.json": {
                "get": {"summary": "this document", "responses": {"200": {"description": "OK"}}}
            },
            "/api/v1/stats": {
                "get": {
                    "summary": "per repository: entries, bytes, hits, misses (fleet-wide); "
                    "database, storage, replicas, upstream health",
                    "responses": {**_ok("Stats"), **_errors()},
                }
            },
            "/api/v1/replicas": {
                "get": {"summary": "the fleet's replicas and whether each is alive",
                        "responses": {**_ok("Replicas"), **_errors()}}
            },
            "/api/v1/in-flight": {
                "get": {"summary": "downloads in progress across the fleet (from the lease rows)",
                        "responses": {**_ok("InFlightList"), **_errors()}}
            },
            "/api/v1/jobs": {
                "get": {"summary": "every job: last run, outcome, next due, holder; recent "
                        "failures; recent mirror runs", "responses": {**_ok("Jobs"), **_errors()}}
            },
            "/api/v1/entries": {
                "get": {"summary": "a keyset page of a repository's entries (by key, or with "
                        "q by package)", "parameters": _PAGE,
                        "responses": {**_ok("EntryPage"), **_errors("400", "404")}}
            },
            "/api/v1/entries/{repository}/{path}": {
                "get": {"summary": "one entry: digests, upstream URL, times, policy",
                        "parameters": [repository, _path("path", "the entry's key")],
                        "responses": {**_ok("EntryDetail"), **_errors("400", "404")}},
                "delete": {"summary": "purge one entry (the next request goes upstream); "
                                      "409 while its download is in flight",
                           "parameters": [repository, _path("path", "the entry's key")],
                           "responses": {**_ok("Purged"), **_errors("400", "404", "409")}},
            },
            "/api/v1/packages": {
                "get": {"summary": "a keyset page of a repository's packages",
                        "parameters": _PAGE,
                        "responses": {**_ok("PackagePage"), **_errors("400", "404")}}
            },
            "/api/v1/packages/{repository}/{package}": {
                "get": {"summary": "a package's versions and files",
                        "parameters": [repository, _path("package", "e.g. requests")],
                        "responses": {**_ok("Package"), **_errors("400", "404")}},
                "delete": {"summary": "purge every entry of a package, negative ones too",
                           "parameters": [repository, _path("package", "e.g. requests")],
                           "responses": {**_ok("Purged"), **_errors("400", "404")}},
            },
            "/api/v1/mirror-runs": {
                "post": {
                    "summary": "start a mirror run: purls and/or an SBOM",
                    "requestBody": {"required": True, "content": {
                        JSON: {"schema": {"$ref": "#/components/schemas/MirrorRequest"}}}},
                    "responses": {**_ok("MirrorRunStarted", "202", "started"),
                                  **_errors("400", "413", "415")},
                }
            },
            "/api/v1/mirror-runs/{run_id}": {
                "get": {"summary": "a mirror run's progress and outcome",
                        "parameters": [_path("run_id", "the id POST answered")],
                        "responses": {**_ok("MirrorRun"), **_errors("400", "404")}},
                "delete": {"summary": "cancel a running mirror run",
                           "parameters": [_path("run_id", "the id POST answered")],
                           "responses": {**_ok("MirrorRun", "202", "cancellation asked"),
                                         **_errors("400", "404", "409")}},
            },
        },
    }  # fmt: skip
