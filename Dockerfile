# Open-AutoGLM's serving image: the NGC Triton image of the release inside nvidia-pytriton (Triton 2.51, 24.10),
# with the python_glm backend, the model repository, the trained demo checkpoint and the pinned requirements baked in,
# so that nothing is installed when a container starts.
#
#   docker build -t open-autoglm:0.1.0 .
#   docker run --gpus 1 --shm-size 2g -p 8000-8002:8000-8002 -p 9000:9000 open-autoglm:0.1.0    # the demo model
#   docker run --gpus 1 --shm-size 2g -p 8000-8002:8000-8002 -p 9000:9000 \
#       -v /path/to/glm-4-9b-chat-hf:/models/glm:ro -e GLM_MODEL_DIR=/models/glm open-autoglm:0.1.0
#
# The entry point is the launcher (scripts/triton_server.py: restarts, drain on SIGTERM); arguments after the image
# name are its flags (e.g. --openai-port 0, --drain-grace 60). docker-compose.yml and deploy/kubernetes/ use it.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    APP=/opt/open-autoglm

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# jemalloc: the launcher preloads it (a soak with glibc's malloc grew 446 MB an hour: docs/operations.md). gcc:
# the engine compiles its CPU kernels (decode attention, the layers' products and norms) for the CPU it runs on, at
# first use (CPU pods; without a compiler they fall back to the slower torch paths). The versions are the base image's Ubuntu release's, which the
# pinned base tag fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libjemalloc2 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Requirements first, so that a change of code does not reinstall torch. PyPI's torch wheel is the CUDA build.
COPY requirements-gpu.txt clients/requirements.txt ${APP}/requirements/
RUN pip install --no-cache-dir -r ${APP}/requirements/requirements-gpu.txt -r ${APP}/requirements/requirements.txt

# A non-root user of the same uid as the base image's triton-server user; Kubernetes' runAsNonRoot checks the uid.
RUN id -u triton-server >/dev/null 2>&1 || useradd --uid 1000 --create-home --shell /bin/bash triton-server

COPY backends/python_glm /opt/tritonserver/backends/python_glm
COPY glm_tools ${APP}/glm_tools
COPY scripts ${APP}/scripts
COPY openai_front ${APP}/openai_front
COPY clients ${APP}/clients
COPY demo_checkpoint ${APP}/checkpoints/glm-demo
# Writable by the server's user: scripts/glm_versions.py adds versions and the traffic split there.
COPY --chown=1000:1000 model_repository ${APP}/model_repository

# glm_tools for the launcher and glm_versions.py; triton_glm and glm_engine for glm_versions.py.
ENV PYTHONPATH=${APP}:/opt/tritonserver/backends/python_glm
WORKDIR ${APP}
USER 1000

# HTTP, gRPC, metrics, the OpenAI-compatible API.
EXPOSE 8000 8001 8002 9000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=30 \
    CMD ["curl", "-sf", "localhost:8000/v2/health/ready"]
ENTRYPOINT ["python3", "scripts/triton_server.py", "--installed-triton", "/opt/tritonserver", "--host", "0.0.0.0"]
