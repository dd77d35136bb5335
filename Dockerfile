# The proxy as a container: `docker build -t artifact-proxy .`
# Run: docker run -p 8080:8080 -v proxy-data:/srv/proxy \
#        -e PROXY_UPSTREAM_PYPI=https://upstream.example/simple/ artifact-proxy
#
# Reproducible: every dependency comes from requirements.lock (exact versions and hashes;
# `make lock` regenerates it), installed in a layer of its own before the sources are
# copied, so a source change rebuilds only the last small layers.
# Written for the classic builder too (no RUN --mount, no heredocs).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# 1. Dependencies, from the lock only: cached until requirements.lock changes.
COPY requirements.lock requirements-build.lock ./
RUN pip install --require-hashes --no-deps --prefix=/deps -r requirements.lock \
 && pip install --require-hashes --no-deps -r requirements-build.lock
# 2. The project itself, built with the locked build backend (no isolated build env,
#    so nothing unpinned is downloaded) and installed without dependencies.
COPY pyproject.toml README.md ./
COPY migrations ./migrations
COPY proxy ./proxy
RUN pip install --no-deps --no-build-isolation --prefix=/app .

FROM python:3.11-slim
# A numeric user (runAsNonRoot can verify it); named `app` because Debian images already
# have a `proxy` user (uid 13).
ARG UID=10001
RUN groupadd --system --gid "$UID" app \
 && useradd --system --uid "$UID" --gid "$UID" --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin app \
 && mkdir -p /srv/proxy && chown "$UID:$UID" /srv/proxy
COPY --from=build /deps /usr/local
COPY --from=build /app /usr/local
COPY deploy/healthcheck.py /usr/local/bin/proxy-healthcheck
USER 10001:10001
ENV PROXY_LISTEN=0.0.0.0:8080 \
    PROXY_STORAGE_PATH=/srv/proxy \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
EXPOSE 8080
VOLUME /srv/proxy
# Liveness on the address in PROXY_LISTEN (read when the check runs). Compose checks
# readiness instead: `proxy-healthcheck /readyz`.
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
  CMD ["proxy-healthcheck", "/healthz"]
# dumb-init (from the lock) is PID 1 and forwards signals to `proxy`: `docker stop`
# sends SIGTERM, the proxy releases its fetch leases and finishes in-flight hits within
# 10 s (give it a stop grace period of 15 s or more), then exits.
STOPSIGNAL SIGTERM
ENTRYPOINT ["dumb-init", "--", "proxy"]
CMD ["serve"]
