"""Debian's system Maven repository (filled by its lib*-java packages) as an upstream.

Used by the real-client tests and by bench/maven.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

DEBIAN_MAVEN_REPO = Path("/usr/share/maven-repo")
DEBIAN_MAVEN_PACKAGES = (
    "libmaven-resources-plugin-java libmaven-compiler-plugin-java libmaven-jar-plugin-java "
    "libsurefire-java libmaven-install-plugin-java libmaven-clean-plugin-java junit4"
)


class MissingMavenRepo(RuntimeError):
    pass


def copy_with_checksums(target: Path) -> Path:
    """Copy the repository into ``target`` with a generated .sha1 beside every file.

    Files are absolute symlinks to the originals (the repository is ~300 MB of jars);
    the .sha1 files make the proxy verify every artifact it stores.
    """
    needed = DEBIAN_MAVEN_REPO / "org/apache/maven/plugins/maven-surefire-plugin"
    if not needed.is_dir():
        raise MissingMavenRepo(
            f"{needed} is missing: apt-get install {DEBIAN_MAVEN_PACKAGES} (.ci/run does)"
        )
    for folder, _dirs, files in os.walk(DEBIAN_MAVEN_REPO):
        target_dir = target / Path(folder).relative_to(DEBIAN_MAVEN_REPO)
        target_dir.mkdir(parents=True, exist_ok=True)
        for name in files:
            real = (Path(folder) / name).resolve()
            if not real.is_file() or name.endswith((".sha1", ".md5", ".sha256", ".sha512")):
                continue
            (target_dir / name).symlink_to(real)
            digest = hashlib.sha1(real.read_bytes()).hexdigest()
            (target_dir / f"{name}.sha1").write_text(digest)
    return target
