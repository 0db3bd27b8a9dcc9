# syntax=docker/dockerfile:1
# transportd images (docker-compose.yml builds both):
#   target "daemon":    python slim + transportd, non-root; ENTRYPOINT is the `transportd` CLI
#   target "analytics": the same plus Java 17 and PySpark for `transportd analyze`
# docker build --target daemon -t transportd:0.1.0 .
#
# PYTHON_IMAGE: the official python image by default; `make compose-up` (scripts/compose.sh) passes
# a base image made with debootstrap where no registry can be reached (Debian's python3 3.11 with
# `python`/`pip` names and no EXTERNALLY-MANAGED marker, like the official image).
# pip's downloads and the wheels it builds are kept in a build cache mount between builds.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build: a wheel of the project
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY transportd ./transportd
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --wheel-dir /wheels .

# ---------------------------------------------------------------- base: the non-root user and its folders
# No project code here, so the analytics image's Java and PySpark layers stay cached across code changes.
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10025 transportd \
 && useradd --system --uid 10025 --gid transportd --home-dir /var/lib/transportd --shell /usr/sbin/nologin transportd \
 && mkdir -p /etc/transportd /var/lib/transportd/mailboxes /var/log/transportd/msgtrk /var/spool/transportd-sink \
 && chown -R transportd:transportd /var/lib/transportd /var/log/transportd /var/spool/transportd-sink

# ---------------------------------------------------------------- daemon
FROM base AS daemon
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
# Named volumes mounted on these folders start with their ownership, so the non-root user can write
# them. No VOLUME instruction: containers that mount nothing there (the sink, one-off `run`s) would
# leave anonymous volumes behind.
USER transportd
WORKDIR /var/lib/transportd
# frontend (SMTP), transport connector (peers), Prometheus metrics
EXPOSE 2525 2526 9101
ENTRYPOINT ["transportd"]
CMD ["serve", "--config", "/etc/transportd/transportd.toml"]

# ---------------------------------------------------------------- spark: Java 17 and PySpark (no project code)
FROM base AS spark
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install "pyspark>=4.0,<5"
RUN mkdir -p /reports && chown transportd:transportd /reports

# ---------------------------------------------------------------- analytics (Spark over MSGTRK logs)
FROM spark AS analytics
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
USER transportd
WORKDIR /reports
ENTRYPOINT ["transportd"]
CMD ["analyze", "--help"]
