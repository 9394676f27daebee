# The fusedserve worker: Ray head/worker pods of an InferenceDeployment (group controller, rank actors).
# CUDA + torch + FlashInfer (fused all-reduce + residual + RMSNorm) + Ray, version-matched with the CRD's
# default spec.rayVersion.
#
#   docker build -f docker/worker.Dockerfile -t ghcr.io/fusedserve/worker:0.1.0 .
#
# FlashInfer JIT-compiles its fused all-reduce on first use (minutes): mount a volume at
# /home/ray/.cache/flashinfer to keep the build between pod restarts.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# boto3: the s3:// model download of the pods' init container (python -m fusedserve.model_download).
# Keep these in step: RAY_VERSION = the CRD default of spec.rayVersion (operator/api.py), TORCH_INDEX = the
# CUDA version of the base image.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG FLASHINFER_VERSION=0.6.18.post1
ARG RAY_VERSION=2.60.0

# NVLink multicast stays off (NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST): FlashInfer takes its
# multicast-free IPC workspace.
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# The operator runs the pods' commands in a login shell (bash -l), which may reset PATH from /etc/profile:
# profile.d puts the venv back in front.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/fusedserve.sh

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
 && pip install "flashinfer-python==${FLASHINFER_VERSION}" "ray[default]==${RAY_VERSION}" "boto3>=1.34"

WORKDIR /opt/fusedserve
COPY pyproject.toml README.md ./
COPY fusedserve ./fusedserve
COPY operator ./operator
COPY worker ./worker
COPY models ./models
RUN pip install . \
 && python -c "from importlib.metadata import version as v; import fusedserve.worker.engine; \
assert (v('ray'), v('flashinfer-python')) == ('${RAY_VERSION}', '${FLASHINFER_VERSION}'), (v('ray'), v('flashinfer-python'))"
# The examples' checkpoints (the tiny code model and its EAGLE3 draft), so `kubectl apply -f examples/...`
# works with this image as it is: their relative model paths resolve from this working directory.
COPY examples ./examples

# Non-root, as Ray's own images: user "ray", UID 1000 (Ubuntu's image has a user "ubuntu" there), with a
# writable home for Ray's session files and FlashInfer's JIT cache.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --uid 1000 --user-group --create-home --home-dir /home/ray --shell /bin/bash ray \
 && mkdir -p /home/ray/.cache/flashinfer \
 && chown -R 1000:1000 /home/ray /opt/fusedserve
USER 1000:1000
ENV HOME=/home/ray
