# convergenced container image.
#
#   docker build -t convergenced .
#   docker run -d --name convergenced --network host \
#     -v /etc/convergenced:/etc/convergenced:ro \
#     -v convergenced-state:/var/lib/convergenced \
#     -v /run/convergenced:/run/convergenced \
#     convergenced
#
# The config (convergenced.toml, tls/, identity) is mounted read-only at
# /etc/convergenced; set metrics_listen = "0.0.0.0:9464" there so the metrics port is
# reachable from outside the container. The daemon runs as uid/gid 10001: private keys
# must belong to that uid, mode 0600 (it refuses keys a group may read), and a host
# /run/convergenced must be writable by it (install -d -m 0750 -o 10001 -g 10001).
# Training containers mount the same /run/convergenced to reach the socket; their
# processes need gid 10001 (`--group-add 10001`), listed in [local] allowed_gids.

# --- build: turn the package and its dependencies into wheels ----------------------
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# Only what the package build reads (README.md is the project's readme in
# pyproject.toml); tests, benchmarks and docs stay out of the image.
COPY pyproject.toml README.md ./
COPY convergenced ./convergenced
RUN pip wheel --wheel-dir /wheels .

# --- runtime -------------------------------------------------------------------------
FROM python:3.11-slim
LABEL org.opencontainers.image.title="convergenced" \
      org.opencontainers.image.description="Per-node daemon that tells distributed training which checkpoint every node can restore" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

# Runtime dependencies only (no dev extra), from the wheels built above: nothing is
# compiled here, and no compiler is in the image. The wheels are bind-mounted, not
# copied, so they leave no layer behind. pip byte-compiles at install, so a read-only
# root filesystem costs nothing at start.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels convergenced

# Bytecode was compiled above; at run time nothing is written next to the code.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

# A fixed, numeric, unprivileged user: Kubernetes' runAsNonRoot can only check a
# numeric USER, and training containers must know the gid (10001) to reach the socket.
RUN groupadd --system --gid 10001 convergenced \
 && useradd --system --uid 10001 --gid convergenced --no-create-home \
      --home-dir /var/lib/convergenced --shell /usr/sbin/nologin convergenced \
 && install -d -m 0750 -o root -g convergenced /etc/convergenced \
 && install -d -m 0750 -o convergenced -g convergenced /var/lib/convergenced /run/convergenced

# State (write-ahead log, lock) must outlive the container: an
# acknowledged commit is a promise. The socket directory is shared with training
# containers (the daemon makes the socket 0660).
VOLUME ["/var/lib/convergenced", "/run/convergenced"]

# 7946/tcp: peer links (mutual TLS). 9464/tcp: /metrics, /healthz, /readyz.
EXPOSE 7946 9464

USER 10001:10001

# Exit 0 when the daemon answers, 1 otherwise; reads the same config as the daemon.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["convergenced", "healthcheck"]

# SIGTERM drains for at most 5 s (within docker stop's default 10 s). The daemon is PID 1
# but installs its own signal handlers and spawns no children, so no init is needed.
STOPSIGNAL SIGTERM
ENTRYPOINT ["convergenced", "run", "--config", "/etc/convergenced/convergenced.toml"]
