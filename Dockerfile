# shmcache in a container. The cache lives in the container's /dev/shm: run with
# --ipc=host (share the host's) or --shm-size=<size> (Docker's default is 64 MB).
# Until the daemon lands this image runs the demo; `shmcache serve` will replace it.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shmcache ./shmcache
COPY service ./service
COPY client ./client
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 1000 shmcache

USER shmcache
CMD ["shmcache", "demo"]
