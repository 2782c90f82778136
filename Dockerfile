# shmcache daemon in a container (docs/daemon.md, "Docker").
#
# The cache lives in the container's /dev/shm: run with --ipc=host (the host's /dev/shm)
# or --ipc=shareable --shm-size=<size> (Docker's default /dev/shm is 64 MB). Training
# containers share it with --ipc=host or --ipc=container:<this one>, mount the socket
# volume (-v shmcache-run:/run/shmcache) and run as the same uid (1000).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SHMCACHE_SOCKET=/run/shmcache/daemon.sock

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shmcache ./shmcache
COPY service ./service
COPY client ./client
# deploy/: what a training pod's init container runs to wait for the node's preload.
COPY deploy/shmcache_ready.py /usr/local/bin/shmcache-ready
# Installs this checkout (not a registry package); its dependencies' bounds live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[service]" \
    && useradd --create-home --uid 1000 shmcache \
    && mkdir -p /run/shmcache \
    && chown 1000:1000 /run/shmcache \
    && chmod 0700 /run/shmcache

# The control socket: mount the same volume into the containers that load and evict.
VOLUME ["/run/shmcache"]
USER 1000:1000

HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(4); s.connect(os.environ['SHMCACHE_SOCKET']); s.sendall(b'GET /v1/health HTTP/1.0\\r\\nHost: shmcache\\r\\n\\r\\n'); sys.exit(0 if s.recv(16).startswith(b'HTTP/1.1 200') else 1)"]

CMD ["shmcache", "serve"]
