# applier: a small runtime image. Build tools stay in the build stage.
#   docker build -t applier .
#   docker run --rm applier run --source "$SOURCE" --target "$TARGET" --slot s --publication p
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY applier ./applier
COPY migrations ./migrations
# The wheel carries the compiled decoder accelerator and the migrations (as applier._migrations).
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels applier \
 && rm -rf /wheels \
 && useradd --system --uid 10001 --no-create-home applier
USER applier
# Liveness: the CLI imports and the decoder loads (the worker's own /healthz arrives with metrics).
HEALTHCHECK --interval=30s --timeout=5s CMD ["python", "-c", "import applier.protocol, applier.worker"]
ENTRYPOINT ["applier"]
CMD ["--help"]
