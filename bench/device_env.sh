# Source on the GPU machine (the device tool runs in the repo root): installs the carried .whl/
# wheels (FlashInfer and its needs) and the prebuilt FlashInfer modules into /tmp/site, lays the
# package out as `fusedserve` under /tmp/pkg without installing it, and keeps NVLink multicast off.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /tmp/site/flashinfer/data && tar -C /tmp/site/flashinfer/data -xzf .whl/flashinfer-aot-*.tar.gz || return 1
mkdir -p /tmp/pkg/fusedserve && cp fusedserve/*.py /tmp/pkg/fusedserve/
for d in models worker operator; do ln -sfn "$PWD/$d" "/tmp/pkg/fusedserve/$d"; done
export PYTHONPATH=/tmp/pkg:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
