"""What ``storage.verify_reads`` costs a hit (docs/architecture.md, "Blobs verified when
read").

    .venv/bin/python bench/verify_reads.py [--duration 10] [--connections 8]

Prints MB/s and p50/p99 of cached hits on a 1 MiB and a 50 MiB file (wrk, one proxy
process), with ``storage.verify_reads`` off (the default: a file this process verified
is sent as is) and on (every read hashed as it is sent), side by side. Needs wrk.
"""

from __future__ import annotations

import argparse
import shutil

import httpx

from bench.common import make_file, start_proxy, start_upstream, workdir, wrk

FILES = {"1 MiB": "files/one-1.0.bin", "50 MiB": "files/fifty-1.0.bin"}
SIZES = {"1 MiB": 2**20, "50 MiB": 50 * 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()

    work = workdir("verify-reads")
    root = work / "upstream"
    for label, path in FILES.items():
        make_file(root / path, SIZES[label])
    upstream, upstream_url = start_upstream(root, work)
    results: dict[tuple[str, bool], dict[str, float]] = {}
    try:
        for verify_reads in (False, True):
            config = work / f"proxy-{verify_reads}.toml"
            config.write_text(f"""
[server]
access_log = false
[storage]
path = "{work / f"data-{verify_reads}"}"
verify_reads = {"true" if verify_reads else "false"}
[[repositories]]
name = "raw"
format = "raw"
upstream = "{upstream_url}/"
""")
            proxy, url = start_proxy(config, work, f"proxy-{verify_reads}")
            try:
                for label, path in FILES.items():
                    answer = httpx.get(f"{url}/raw/{path}", timeout=120)  # the miss
                    assert answer.status_code == 200, answer.text
                    results[label, verify_reads] = wrk(
                        f"{url}/raw/{path}", args.connections, args.duration
                    )
            finally:
                proxy.stop()
        print(f"cached hits, {args.connections} connections, {args.duration} s each")
        print(f"{'file':>8}  {'verify_reads = false':>28}  {'verify_reads = true':>28}")
        for label in FILES:
            cells = []
            for verify_reads in (False, True):
                r = results[label, verify_reads]
                cells.append(
                    f"{r['bytes_s'] / 1e6:>7,.0f} MB/s p50 {r.get('p50_ms', 0):>6.1f} ms "
                    f"p99 {r.get('p99_ms', 0):>6.1f}"
                )
            print(f"{label:>8}  {cells[0]:>28}  {cells[1]:>28}")
    finally:
        upstream.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
