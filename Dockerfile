# expstream: one image for every stage (docker-compose.yml runs `expstream stage NAME` in it).
#
#   docker build -t expstream .                                    # torch from PyPI (see below)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t expstream:cpu .
#   docker build --build-arg EXTRAS=vllm -t expstream:vllm .       # + vLLM for generate.backend: vllm
#
# torch comes in as a dependency of the project (pyproject.toml). On linux/x86_64 the PyPI wheel
# is the CUDA build (it bundles the CUDA runtime: the host needs only the NVIDIA driver and the
# NVIDIA container toolkit, and the GPU stages reserve a device in docker-compose.yml). For a
# smaller CPU-only image install torch from the CPU index first with TORCH_INDEX_URL; to match a
# different CUDA version use https://download.pytorch.org/whl/cu12X.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=""
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The sources (.dockerignore keeps out .venv, runs/, models/, caches and VCS data).
COPY . /src

RUN set -eux; \
    if [ -n "$TORCH_INDEX_URL" ]; then pip install "torch>=2.3" --index-url "$TORCH_INDEX_URL"; fi; \
    if [ -n "$EXTRAS" ]; then pip install "/src[$EXTRAS]"; else pip install /src; fi; \
    install -D -m 0644 /src/topology.yaml /etc/expstream/topology.yaml; \
    rm -rf /src; \
    useradd --create-home --uid 1000 --shell /usr/sbin/nologin expstream; \
    mkdir -p /work /models; \
    chown expstream:expstream /work /models

# Non-root. /work is the working directory (builtin tiny models are cached under .cache/ there);
# /models is where docker-compose.yml mounts ./models. The default topology is at
# /etc/expstream/topology.yaml (docker-compose.yml passes it, or $EXPSTREAM_TOPOLOGY, to --topology).
USER expstream
WORKDIR /work

# No ENTRYPOINT: compose gives each service its full command (`expstream stage generate ...`).
CMD ["expstream", "--help"]
