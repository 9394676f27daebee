# Source on the GPU machine (the device tool runs in the repo root): installs the carried .whl/
# wheels (FlashInfer and its needs) and the prebuilt FlashInfer modules (every flashinfer-aot-*.tar.gz
# in .whl/, from shared/gpu/) into /tmp/site, lays the package out as `fusedserve` under /tmp/pkg
# without installing it, and keeps NVLink multicast off. Rebuilding a module for another FlashInfer,
# CUDA or head size: run once with it missing (FlashInfer JIT-compiles it under
# $FLASHINFER_WORKSPACE_BASE), then pack each built .so as aot/<name>/<name>.so (shared/gpu/README.md).
# The .whl/ files, fetched here once (cuda-tile has manylinux2014 wheels only, so both platforms are named):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl flashinfer-python==0.6.18.post1 apache-tvm-ffi nccl4py cuda-tile
#   cp ../shared/gpu/flashinfer-aot-*.tar.gz .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /tmp/site/flashinfer/data
for t in .whl/flashinfer-aot-*.tar.gz; do tar -C /tmp/site/flashinfer/data -xzf "$t" || return 1; done
mkdir -p /tmp/pkg/fusedserve && cp fusedserve/*.py /tmp/pkg/fusedserve/
for d in models worker operator; do ln -sfn "$PWD/$d" "/tmp/pkg/fusedserve/$d"; done
export PYTHONPATH=/tmp/pkg:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws PYTHONUNBUFFERED=1
