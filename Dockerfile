# expost: two stages. The builder turns the project into a wheel and installs it, with its pinned-range
# dependencies (all available as binary wheels), into a virtualenv; the runtime stage copies only that
# virtualenv onto a clean python:3.11-slim and runs as an unprivileged user.
#
#   docker build -t expost .        docker compose up      (docker-compose.yml: PostgreSQL, API, worker)
#
# The container runs `expost migrate` and then `expost serve` (docs/operations.md, "Containers").

# ----- builder --------------------------------------------------------------------------------------
FROM python:3.11-slim AS builder

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY mechanisms ./mechanisms
COPY service ./service
COPY migrations ./migrations
COPY clients ./clients
# service/store/migrate.py finds the Alembic scripts beside the installed packages (site-packages/migrations).
RUN pip wheel --no-deps --wheel-dir /wheels . ./clients/python \
 && pip install /wheels/*.whl \
 && cp -r migrations "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/migrations" \
 && expost --help > /dev/null

# ----- runtime --------------------------------------------------------------------------------------
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    EXPOST_DATABASE_URL=sqlite:////var/lib/expost/expost.db \
    EXPOST_DATA_DIR=/var/lib/expost/data \
    EXPOST_LOG_JSON=true \
    EXPOST_WORKERS=2

RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/expost --shell /usr/sbin/nologin expost \
 && mkdir -p /var/lib/expost/data \
 && chown -R expost:expost /var/lib/expost
COPY --from=builder /opt/venv /opt/venv

USER expost
WORKDIR /var/lib/expost
VOLUME ["/var/lib/expost"]
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=5 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]

# The server: PROMETHEUS_MULTIPROC_DIR (default /tmp/expost-metrics) is the metrics directory its worker
# processes share, emptied at each start; then the schema upgrade; then the server, with `exec` so that it
# gets the container's signals. (Set only here, not in ENV: `expost worker` and other commands run in
# this image without it.)
CMD ["sh", "-c", "export PROMETHEUS_MULTIPROC_DIR=\"${PROMETHEUS_MULTIPROC_DIR:-/tmp/expost-metrics}\" && mkdir -p \"$PROMETHEUS_MULTIPROC_DIR\" && find \"$PROMETHEUS_MULTIPROC_DIR\" -maxdepth 1 -name '*.db' -delete && expost migrate && exec expost serve --host 0.0.0.0 --port 8000 --workers \"$EXPOST_WORKERS\""]
