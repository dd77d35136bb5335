"""What the release policy costs a cache hit (docs/architecture.md, "Release policy").

    .venv/bin/python bench/policy_hits.py [--duration 10] [--connections 32]

Runs one proxy process three times on the same cached files: without a policy, with a
3-day cooldown enforced, and with the same cooldown in report mode. For each it prints
the requests/s and latency (wrk) of a cached 11 KB wheel (the gate's check on every
hit: its version's decision, already known) and of a cached project page served as
JSON (the page rendered from its model, its judgement and rendering already known).
Needs wrk (apt-get install wrk).
"""

from __future__ import annotations

import argparse
import shutil

import httpx

from bench.common import make_file, start_proxy, start_upstream, workdir, wrk

SMALL = "small/small-1.0-py3-none-any.whl"
JSON_V1 = "application/vnd.pypi.simple.v1+json"
POLICIES = {
    "no policy": "",
    "cooldown 3d": '[policy]\ncooldown = "3d"\nunknown_publish_time = "allow"\n',
    "cooldown 3d, report": (
        '[policy]\ncooldown = "3d"\nunknown_publish_time = "allow"\nmode = "report"\n'
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, files)")
    args = parser.parse_args()

    work = workdir("policy-hits")
    root = work / "upstream"
    make_file(root / SMALL, 11 * 1024)
    upstream, upstream_url = start_upstream(root, work)
    rows: list[tuple[str, dict[str, float], dict[str, float]]] = []
    try:
        for name, policy in POLICIES.items():
            config = work / f"proxy-{len(rows)}.toml"
            config.write_text(f"""
[storage]
path = "{work / "data"}"
{policy}
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{upstream_url}/simple/"
""")
            proxy, url = start_proxy(config, work, f"proxy-{len(rows)}")
            try:
                file_url = f"{url}/pypi/files/{SMALL}"
                page_url = f"{url}/pypi/simple/small/"
                assert httpx.get(file_url, timeout=60).status_code == 200
                assert httpx.get(page_url, headers={"Accept": JSON_V1}).status_code == 200
                wheel = wrk(file_url, args.connections, args.duration)
                page = wrk(page_url, args.connections, args.duration, headers={"Accept": JSON_V1})
                rows.append((name, wheel, page))
            finally:
                proxy.stop()
    finally:
        upstream.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'':22} {'cached 11 KB wheel':>34}   {'cached project page (JSON)':>34}")
    for name, wheel, page in rows:
        print(f"{name:22} {_figures(wheel)}   {_figures(page)}")


def _figures(result: dict[str, float]) -> str:
    if result.get("errors"):
        return f"{'errors (not 200): see the proxy log':>34}"
    return (
        f"{result['requests_s']:>8,.0f} req/s p50 {result.get('p50_ms', 0):5.2f} ms "
        f"p99 {result.get('p99_ms', 0):5.2f} ms"
    )


if __name__ == "__main__":
    main()
