# applier: a small runtime image. Build tools stay in the build stage.
#   docker build -t applier .
#   docker run --rm -p 9188:9188 applier run --source "$SOURCE" --target "$TARGET" --slot s --publication p
# Metrics, /healthz and /readyz listen on APPLIER_METRICS_PORT (9188); the health check asks /healthz.
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY applier ./applier
COPY migrations ./migrations
# The wheel carries the compiled C accelerators and the migrations (as applier._migrations);
# its dependencies are built here too, so the final stage installs offline and needs no compiler.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels applier \
 && rm -rf /wheels \
 && useradd --system --uid 10001 --no-create-home applier \
 && mkdir -p /var/lib/applier/spill \
 && chown applier /var/lib/applier/spill
USER 10001
ENV APPLIER_METRICS_PORT=9188 \
    APPLIER_SPILL_DIR=/var/lib/applier/spill \
    PYTHONUNBUFFERED=1
EXPOSE 9188
VOLUME ["/var/lib/applier/spill"]
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "applier.ops.healthcheck"]
ENTRYPOINT ["applier"]
CMD ["--help"]
