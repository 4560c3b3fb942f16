# syntax=docker/dockerfile:1
# The production image of recsys: `docker run IMAGE` runs tonight's job on the embedded data;
# pass other arguments to run any `recsys` command, e.g. `nightly --config configs/x.yaml`.
#   docker build -t recsys .
#   docker run --rm -v "$PWD/recsys-work:/work/recsys-work" recsys
# The same environment as a Beam SDK harness for Dataflow / Flink (`--sdk_container_image`,
# docs/OPERATIONS.md): a separate target, the default stays the `recsys` image.
#   docker build --target beam-sdk -t recsys-beam-sdk .
# For NVIDIA GPUs (deploy/kubernetes/gpu/, deploy/README.md): TensorFlow's CUDA wheels
# (tensorflow[and-cuda], the `gpu` extra), so CUDA and cuDNN come from the same pinned install
# and the host needs only the NVIDIA driver and container toolkit.
#   docker build --target recsys-gpu -t recsys-gpu .
# Docker cannot run where this file is written and tested: the stages are checked by
# tests/test_dockerfile.py and hadolint, never built there.
#
# The base is pinned by its full tag. For byte-reproducible builds append the digest that
# `docker buildx imagetools inspect python:3.11.14-slim-bookworm` prints (@sha256:...); it is
# not written here because it could not be checked from the machine this file was made on.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# Must equal the apache-beam pin in constraints.txt (tests/test_dockerfile.py checks): the
# harness boot program and the SDK installed in the venv have to be the same release.
ARG BEAM_VERSION=2.77.0

# The sources and an empty venv, shared by the CPU and GPU builders.
FROM ${PYTHON_IMAGE} AS source
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY recsys ./recsys
COPY beam_jobs ./beam_jobs
COPY serving_export ./serving_export
COPY conductor ./conductor

FROM source AS builder
# The same command as the Makefile and CI (tests/test_dockerfile.py keeps them in step), but a
# regular install (no -e: the source tree is not shipped) without the dev extras.
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip install -c constraints.txt .

# The same install with the `gpu` extra: tensorflow[and-cuda] at the pinned TensorFlow, and
# the NVIDIA wheels it pulls in pinned in constraints.txt too. BuildKit builds it only for
# the recsys-gpu target.
FROM source AS builder-gpu
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip install -c constraints.txt ".[gpu]"

# Only the SDK harness boot program is taken from Beam's image (its Python must match ours:
# 3.11). BuildKit pulls it only when the beam-sdk target is built.
FROM apache/beam_python3.11_sdk:${BEAM_VERSION} AS beam-boot

# What every image shares: the environment and the unprivileged user.
FROM ${PYTHON_IMAGE} AS base
LABEL org.opencontainers.image.title="recsys" \
      org.opencontainers.image.description="Nightly retraining of two-tower retrieval models" \
      org.opencontainers.image.licenses="Apache-2.0"
# TFRS needs Keras 2 (tf_keras); TensorFlow picks its Keras at first import.
ENV TF_USE_LEGACY_KERAS=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH
RUN groupadd --gid 10001 recsys \
    && useradd --uid 10001 --gid recsys --create-home --home-dir /home/recsys \
       --shell /usr/sbin/nologin recsys
# The OpenMP runtime that implicit's compiled extensions link (libgomp.so.1; its wheels do not
# bundle it and the slim image lacks it): a runtime library, no build tool. Its version is
# the Debian release's, fixed by the pinned base image tag and its security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /work

# The CPU venv, shared by the recsys and beam-sdk images.
FROM base AS runtime
# Same base image and path as the builder, so the venv's interpreter links and shebangs hold.
COPY --from=builder /opt/venv /opt/venv

# The Beam SDK harness: the runner starts /opt/apache/beam/boot, which fetches the job's staged
# files and runs the SDK worker with `python` from PATH, i.e. the recsys venv (apache-beam,
# beam_jobs, recsys at the versions that submitted the job). Submit with
# --sdk_location=container so nothing is installed at startup.
FROM runtime AS beam-sdk
LABEL org.opencontainers.image.title="recsys-beam-sdk" \
      org.opencontainers.image.description="Beam SDK harness with the recsys preprocessing code"
COPY --from=beam-boot /opt/apache/beam /opt/apache/beam
# By default boot creates a venv with --system-site-packages next to it; made from the venv's
# interpreter, that venv sees /usr/local's packages, not /opt/venv's, so apache_beam and
# beam_jobs would be missing. Run the worker in the image's venv instead.
ENV RUN_PYTHON_SDK_IN_DEFAULT_ENVIRONMENT=1
# No USER here, unlike the recsys image: Dataflow mounts the harness's working folders
# (/var/opt/google) owned by root, so its harness must run as root. Where the runner lets you
# choose (Flink worker-pool pods on Kubernetes), run it as uid 10001 via the securityContext.
ENTRYPOINT ["/opt/apache/beam/boot"]

# The nightly job on NVIDIA GPUs: the recsys image with the GPU venv. TensorFlow loads CUDA
# and cuDNN from the nvidia-* wheels in the venv; XLA's ptxas comes from nvidia-cuda-nvcc.
FROM base AS recsys-gpu
LABEL org.opencontainers.image.title="recsys-gpu"
COPY --from=builder-gpu /opt/venv /opt/venv
# What the NVIDIA container runtime mounts from the host: the driver's compute libraries.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PATH=$PATH:/opt/venv/lib/python3.11/site-packages/nvidia/cuda_nvcc/bin
COPY configs ./configs
RUN mkdir /work/recsys-work && chown recsys:recsys /work/recsys-work
USER 10001:10001
ENTRYPOINT ["recsys"]
CMD ["nightly", "--config", "configs/default.yaml", "--workdir", "/work/recsys-work"]

# The default target (last stage): the nightly job.
FROM runtime AS recsys
COPY configs ./configs
# The working directory (data, runs, exports, MLflow store) is the one place the job writes;
# mount a volume here to keep it.
RUN mkdir /work/recsys-work && chown recsys:recsys /work/recsys-work
# Numeric, so Kubernetes runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
ENTRYPOINT ["recsys"]
CMD ["nightly", "--config", "configs/default.yaml", "--workdir", "/work/recsys-work"]
