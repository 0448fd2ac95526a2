# The RLJob operator image: `rljob operator`, with only the `operator` extra (no torch).
#
#   docker build -t ghcr.io/treetrain/rljob-operator:0.1.0 .
#   make images    # cached by input hash, from a local Debian base when no registry answers
#
# No `# syntax=` line: BuildKit would fetch that frontend from a registry; the built-in one has
# everything used here.
# The Helm chart (charts/rljob-operator) runs it as user 65532 with a read-only root filesystem.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# The project version (pyproject.toml); tests/unit/test_trainer_image.py keeps them equal.
ARG TREETRAIN_VERSION=0.1.0

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY treetrain ./treetrain
COPY operator ./operator
# Wheels for the project and its `operator` extra only.
RUN pip wheel --no-cache-dir --wheel-dir /wheels "/src[operator]"

FROM ${PYTHON_IMAGE}
ARG TREETRAIN_VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels "treetrain[operator]==${TREETRAIN_VERSION}" \
    && python -c "import importlib.util, rljob_operator.runner; assert importlib.util.find_spec('torch') is None" \
    && useradd --uid 65532 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin rljob
USER 65532:65532
# 8080: /metrics, 8081: /healthz (kopf liveness).
EXPOSE 8080 8081
ENTRYPOINT ["rljob"]
CMD ["operator"]
