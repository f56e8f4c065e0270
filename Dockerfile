FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    EXPOST_DATABASE_URL=sqlite:////var/lib/expost/expost.db \
    EXPOST_DATA_DIR=/var/lib/expost/data \
    EXPOST_LOG_JSON=true

WORKDIR /app
COPY pyproject.toml README.md ./
COPY mechanisms ./mechanisms
COPY service ./service
COPY migrations ./migrations
RUN pip install --no-cache-dir -e . \
 && useradd --system --uid 10001 expost \
 && mkdir -p /var/lib/expost && chown expost /var/lib/expost

USER expost
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=5 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"
CMD ["sh", "-c", "expost migrate && exec expost serve --host 0.0.0.0 --port 8000 --workers ${EXPOST_WORKERS:-2}"]
