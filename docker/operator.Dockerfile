# The fusedserve operator: kopf + the Kubernetes client, no torch, no ray.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/fusedserve/operator:0.1.0 .
#
# The package is installed without its dependencies (those are the serving stack: torch, ray, ...); the
# operator's own come from the `operator` extra of pyproject.toml, read here so the list has one source.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fusedserve ./fusedserve
COPY operator ./operator
COPY worker ./worker
COPY models ./models
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['operator']; open('/src/operator-requirements.txt', 'w').write('\n'.join(deps) + '\n')" \
 && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /src/operator-requirements.txt /wheels/ /tmp/install/
RUN pip install --no-deps /tmp/install/fusedserve-*.whl \
 && pip install -r /tmp/install/operator-requirements.txt \
 && rm -rf /tmp/install \
 && python -c "import sys, fusedserve.operator.main; assert 'torch' not in sys.modules and 'ray' not in sys.modules" \
 && groupadd --gid 10001 fusedserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin fusedserve
# Numeric, so Kubernetes can check runAsNonRoot; the chart sets the same UID. The root filesystem may be
# read-only: only /tmp (an emptyDir in the chart) is written.
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8081
ENTRYPOINT ["fusedserve-operator"]
CMD ["--all-namespaces", "--standalone", "--metrics-port", "8080", "--health-port", "8081"]
