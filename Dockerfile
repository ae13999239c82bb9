# One image for every kvmesh service (see docker-compose.yml). CPU torch by default:
#   docker build --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX_URL=<CUDA index> .
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0+cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/kvmesh

# Dependencies first, so that a code change does not reinstall torch.
COPY constraints.txt ./
RUN pip install --extra-index-url "$TORCH_INDEX_URL" "$TORCH_SPEC" -c constraints.txt

COPY pyproject.toml README.md ./
COPY app ./app
COPY cache ./cache
COPY events ./events
RUN pip install . -c constraints.txt

RUN useradd --system --uid 10001 --no-create-home kvmesh
USER kvmesh

CMD ["kvmesh", "--help"]
