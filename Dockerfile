# The proxy as a container: `docker build -t artifact-proxy .`
# Run: docker run -p 8080:8080 -v proxy-data:/srv/proxy \
#        -e PROXY_UPSTREAM_PYPI=https://upstream.example/simple/ artifact-proxy
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY migrations ./migrations
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /srv/proxy proxy \
    && mkdir -p /srv/proxy && chown proxy /srv/proxy
COPY --from=build /install /usr/local
USER proxy
ENV PROXY_LISTEN=0.0.0.0:8080 \
    PROXY_STORAGE_PATH=/srv/proxy \
    PYTHONUNBUFFERED=1
EXPOSE 8080
VOLUME /srv/proxy
HEALTHCHECK --interval=30s --timeout=3s \
  CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"
ENTRYPOINT ["proxy"]
CMD ["serve"]
