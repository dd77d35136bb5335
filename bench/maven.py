"""mvn build times: directly against the upstream folder vs through the proxy, cold and warm.

    .venv/bin/python bench/maven.py [--runs 2]

The upstream is Debian's system Maven repository (with generated .sha1 files), served
by bench/upstream_server.py. Every build starts with an empty local repository
(-Dmaven.repo.local), so each one downloads every plugin and dependency:
- direct: mvn mirror -> upstream folder;
- proxy cold: mvn mirror -> proxy with an empty cache (the proxy fetches and verifies);
- proxy warm: mvn mirror -> proxy whose cache is full (upstream stopped).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import start_proxy, start_upstream, workdir
from tests.maven_repo import copy_with_checksums
from tests.test_jvm_clients import POM, java_project


def mvn(project: Path, mirror: str, local_repo: Path) -> float:
    settings = project.parent / "settings.xml"
    settings.write_text(
        f"<settings><mirrors><mirror><id>m</id><mirrorOf>*</mirrorOf><url>{mirror}</url>"
        "</mirror></mirrors></settings>"
    )
    started = time.monotonic()
    result = subprocess.run(
        ["mvn", "-B", "-q", "--strict-checksums", "-s", str(settings),
         f"-Dmaven.repo.local={local_repo}", "package"],
        cwd=project, capture_output=True, text=True,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"mvn failed:\n{result.stdout[-3000:]}")
    shutil.rmtree(project / "target")
    shutil.rmtree(local_repo)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    work = workdir("maven")
    try:
        repo = copy_with_checksums(work / "repo")
        project = java_project(work / "project")
        (project / "pom.xml").write_text(POM)
        upstream, upstream_url = start_upstream(repo, work)
        direct = [mvn(project, upstream_url + "/", work / "m2") for _ in range(args.runs)]
        proxy_cold, proxy_warm = [], []
        for run in range(args.runs):
            config = work / f"proxy-{run}.toml"
            config.write_text(f"""
[storage]
path = "{work / f"data-{run}"}"
[[repositories]]
name = "maven"
format = "maven"
upstream = "{upstream_url}/"
""")
            proxy, url = start_proxy(config, work, f"proxy-{run}")
            try:
                proxy_cold.append(mvn(project, url + "/maven/", work / "m2"))
                proxy_warm.append(mvn(project, url + "/maven/", work / "m2"))
            finally:
                proxy.stop()
        upstream.stop()
        # Warm again with the upstream gone: served from the cache alone.
        proxy, url = start_proxy(work / "proxy-0.toml", work, "proxy-offline")
        try:
            offline = mvn(project, url + "/maven/", work / "m2")
        finally:
            proxy.stop()
        print("mvn package, empty local repository each time (median of runs):")
        print(f"  direct against the upstream folder : {statistics.median(direct):6.2f} s")
        print(f"  through the proxy, cold cache      : {statistics.median(proxy_cold):6.2f} s")
        print(f"  through the proxy, warm cache      : {statistics.median(proxy_warm):6.2f} s")
        print(f"  through the proxy, upstream stopped: {offline:6.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
