# multimax-serve, CPU image: `python -m service` serving the models mounted at /models on port 8000.
#
#   podman build --format docker -t multimax-serve:cpu .     (or: docker build -t multimax-serve:cpu .)
#   podman run -p 8000:8000 -v /srv/models:/models:ro multimax-serve:cpu
#
# Two stages: the build stage compiles the wheel (with the fused onnxruntime ops prebuilt in it, setup.py) and
# installs it with its dependencies into /opt/venv; the final stage is the base image, that venv and an
# unprivileged user: no compiler, no headers, no writable cache needed. Configuration: the server's environment
# variables (MULTIMAX_SERVE_<OPTION>, docs/SERVICE.md) or arguments after the image name. docs/DEPLOY.md
# ("A container image (CPU)") has the measured size, the build arguments and the CUDA/TensorRT variant.

# Any Debian-based image with Python 3.10+ as `python3` and apt-get (tests/deploy/test_image.py builds one with
# mmdebstrap, since base images cannot be pulled there).
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
# g++ compiles the fused ops against onnxruntime's C API headers, for this stage only: Debian's libonnxruntime-dev
# where the base's Debian has it (trixie on), else setup.py fetches that package (bookworm's Debian has none).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && if apt-cache show libonnxruntime-dev >/dev/null 2>&1; then \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libonnxruntime-dev; fi \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY models/ models/
COPY export/ export/
COPY plugins/ plugins/
COPY service/ service/
RUN pip wheel --no-deps -w /wheels .
# onnxruntime's CPU package: the dependency onnxruntime-gpu also runs on CPUs, but is far larger. The CUDA
# variant sets ORT_PACKAGE=onnxruntime-gpu.
ARG ORT_PACKAGE=onnxruntime
# PyPI's Linux torch is the CUDA build (GBs): the CPU image takes PyTorch's CPU wheels. Any pip options work
# here (the test passes --find-links to a local wheel; the CUDA variant passes nothing).
ARG PIP_EXTRA_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# More requirements, space-separated (the TensorRT variant: "tensorrt>=10.9" from NVIDIA's index).
ARG EXTRA_PACKAGES=""
RUN pip install --no-deps /wheels/multimax_serve-*.whl \
    && python3 -c "import importlib.metadata as m; print('\n'.join(r for r in m.requires('multimax-serve') \
        if 'extra ==' not in r and not r.startswith('onnxruntime-gpu')))" > /tmp/requirements.txt \
    && printf '%s\n' ${ORT_PACKAGE} ${EXTRA_PACKAGES} >> /tmp/requirements.txt \
    && pip install $PIP_EXTRA_ARGS -r /tmp/requirements.txt \
    && cd / && python3 -m plugins.ort_ops --json | grep -q '"source": "prebuilt"'

FROM ${BASE}
RUN useradd --user-group --uid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin multimax
# Hugging Face folders' exports (made on first load, docs/SERVICE.md): a volume here keeps them across containers;
# owned by the server's user so that a fresh named volume is writable too.
RUN mkdir -p /cache && chown 10001:10001 /cache
# The demo models answer until a volume is mounted over /models (the Helm chart's default, Compose without MODELS_DIR).
COPY --from=build /src/models/demo/*.onnx /models/
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MULTIMAX_SERVE_HOST=0.0.0.0 \
    MULTIMAX_SERVE_PORT=8000 \
    MULTIMAX_SERVE_MODEL_DIR=/models \
    MULTIMAX_SERVE_EXPORT_CACHE=/cache
USER 10001:10001
EXPOSE 8000
# Ready once every model is loaded and warmed up (KServe V2 readiness). With --auth-health (or TLS) probe with
# the key (or https) instead.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('MULTIMAX_SERVE_PORT', '8000') + '/v2/health/ready', timeout=4)"]
ENTRYPOINT ["python3", "-m", "service"]
