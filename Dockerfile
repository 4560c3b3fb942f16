# syntax=docker/dockerfile:1
# The production image of recsys: `docker run IMAGE` runs tonight's job on the embedded data;
# pass other arguments to run any `recsys` command, e.g. `nightly --config configs/x.yaml`.
#   docker build -t recsys .
#   docker run --rm -v "$PWD/recsys-work:/work/recsys-work" recsys
#
# The base is pinned by its full tag. For byte-reproducible builds append the digest that
# `docker buildx imagetools inspect python:3.11.14-slim-bookworm` prints (@sha256:...); it is
# not written here because it could not be checked from the machine this file was made on.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY recsys ./recsys
COPY beam_jobs ./beam_jobs
COPY serving_export ./serving_export
# The same command as the Makefile and CI (tests/test_dockerfile.py keeps them in step), but a
# regular install (no -e: the source tree is not shipped) without the dev extras.
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip install -c constraints.txt .

FROM ${PYTHON_IMAGE} AS runtime
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
# Same base image and path as the builder, so the venv's interpreter links and shebangs hold.
COPY --from=builder /opt/venv /opt/venv
WORKDIR /work
COPY configs ./configs
# The working directory (data, runs, exports, MLflow store) is the one place the job writes;
# mount a volume here to keep it.
RUN mkdir /work/recsys-work && chown recsys:recsys /work/recsys-work
# Numeric, so Kubernetes runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
ENTRYPOINT ["recsys"]
CMD ["nightly", "--config", "configs/default.yaml", "--workdir", "/work/recsys-work"]
