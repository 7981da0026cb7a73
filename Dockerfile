# syntax=docker/dockerfile:1
#
# One image for the three specdec services: `specdec serve draft|target|coordinator`.
#
#   docker build --build-arg TORCH_VARIANT=cpu  -t specdec:0.1.0 .        # CPU torch (~1 GB image)
#   docker build --build-arg TORCH_VARIANT=cuda -t specdec:0.1.0-cuda .   # CUDA torch (several GB)
#
# TORCH_VARIANT=cpu takes torch from PyTorch's CPU wheel index; cuda takes the default
# index's Linux build, which bundles its CUDA libraries (the node only needs the NVIDIA
# driver). TORCH_INDEX_URL overrides either, e.g. a cuXXX index for another CUDA.
#
# The base image is pinned by tag and by the digest of its multi-architecture index;
# bump both together (`docker buildx imagetools inspect python:3.11.14-slim-bookworm`).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# ---------------------------------------------------------------- build: a venv in /opt/specdec
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/specdec
ENV PATH=/opt/specdec/bin:$PATH

# torch first, on its own layer: it is most of the image and changes least often
# (pinned by TORCH_VERSION; hadolint cannot see through the variable)
# hadolint ignore=DL3013
RUN set -eu; \
    case "$TORCH_VARIANT" in \
      cpu)  index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX_URL:-}" ;; \
      *)    echo "TORCH_VARIANT must be cpu or cuda, not '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install ${index:+--index-url "$index"} "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY coordinator ./coordinator
# torch is already there and satisfies the package's range, so pip keeps that build
RUN pip install . \
    && specdec serve draft --help > /dev/null

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Distributed lossless speculative decoding: draft, target and coordinator gRPC services" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.specdec.torch-variant="${TORCH_VARIANT}"

# A fixed numeric UID, so Kubernetes' runAsNonRoot can check it (k8s/base uses 10001).
RUN groupadd --system --gid 10001 specdec \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/specdec --create-home \
               --shell /usr/sbin/nologin specdec \
    && mkdir -p /models \
    && chown 10001:10001 /models

COPY --from=build /opt/specdec /opt/specdec

# SPECDEC_CACHE: catalog models are fetched and converted here once (mount a volume).
# Caches that libraries write go to /tmp, so the root filesystem can be read-only.
ENV PATH=/opt/specdec/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECDEC_CACHE=/models \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/cache

USER 10001:10001
WORKDIR /home/specdec
VOLUME ["/models"]
# coordinator (public), draft, target, Prometheus metrics
EXPOSE 50051 50052 50053 9400

# Every server answers the standard gRPC health service; Kubernetes probes it natively.
ENTRYPOINT ["specdec"]
CMD ["--help"]
