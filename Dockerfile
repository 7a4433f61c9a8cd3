# syntax=docker/dockerfile:1
# (The syntax line guarantees heredoc support in RUN, used below.)
#
# Container image for the embedding pipeline: `pipeline` is the entrypoint.
#
#   docker build -t embedding-pipeline .                        # CPU (faiss-cpu)
#   docker build -t embedding-pipeline:gpu --build-arg EXTRAS=gpu .   # CUDA (faiss-gpu)
#   docker run --rm embedding-pipeline run --topic corpus --group g --output /data/out
#
# Two stages: the build stage installs everything into a virtualenv under /opt/venv,
# the runtime stage copies only that virtualenv, so pip's caches and the build context
# never reach the final image.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build

# Comma-separated extras from pyproject.toml, e.g. "gpu" or "gpu,bench". Empty: base install.
ARG EXTRAS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src

# Dependencies first, from pyproject.toml alone, so that editing the code does not
# reinstall torch (several GB) on every build.  The requirement list is read with tomllib
# rather than `pip install .[EXTRAS]` for one reason: faiss-cpu and faiss-gpu both ship the
# `faiss` module and pyproject's marker still selects faiss-cpu with the gpu extra, so
# `.[gpu]` would install both, one over the other.  With the gpu extra, faiss-cpu is left
# out of the list, and the `faiss` module that ends up importable is the GPU build's.
COPY pyproject.toml ./
RUN python - "$EXTRAS" > /tmp/requirements.txt <<'EOF'
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [e.strip() for e in sys.argv[1].split(",") if e.strip()]
optional = project.get("optional-dependencies", {})
unknown = [e for e in extras if e not in optional]
if unknown:
    sys.exit(f"unknown extra(s) {unknown}; pyproject.toml has {sorted(optional)}")
reqs = list(project["dependencies"])
for extra in extras:
    reqs += optional[extra]
if "gpu" in extras:
    reqs = [r for r in reqs if not r.replace("_", "-").lower().startswith("faiss-cpu")]
print("\n".join(reqs))
EOF
# Everything but faiss-gpu first.  For the gpu extra, faiss-cpu is then uninstalled (a
# no-op unless some dependency pulled it in) *before* faiss-gpu is installed: removing it
# afterwards would delete the `faiss` files that faiss-gpu had just written.
RUN cat /tmp/requirements.txt \
    && pip install --upgrade pip \
    && grep -v -i '^faiss-gpu' /tmp/requirements.txt > /tmp/requirements-base.txt \
    && pip install -r /tmp/requirements-base.txt \
    && if printf ',%s,' "$EXTRAS" | grep -q ',gpu,'; then \
        pip uninstall -y faiss-cpu && pip install -r /tmp/requirements.txt; \
    fi

# Then the project itself. --no-deps: the dependencies are in place, and letting pip
# resolve `.` again would bring faiss-cpu back into a GPU image.  The checks fail the
# build early: the entrypoint must start, and a GPU image whose faiss lacks the GPU
# classes is broken.
COPY . .
RUN pip install --no-deps . \
    && pipeline --help > /dev/null \
    && python -c "import faiss; print('faiss', faiss.__version__, \
        'gpu' if hasattr(faiss, 'StandardGpuResources') else 'cpu')" \
    && if printf ',%s,' "$EXTRAS" | grep -q ',gpu,'; then \
        python -c "import faiss; assert hasattr(faiss, 'StandardGpuResources'), 'faiss-cpu won'"; \
    fi


FROM ${PYTHON_IMAGE}

ARG EXTRAS=""
LABEL org.opencontainers.image.title="embedding-pipeline" \
      org.opencontainers.image.description="Kafka-based text-embedding pipeline" \
      org.opencontainers.image.licenses="Apache-2.0" \
      embedding-pipeline.extras="${EXTRAS}"

# A fixed uid so that bind-mounted output directories can be chowned to it on the host.
# /data and /cache are created here, owned by app, because a named volume mounted on
# them starts with this owner; otherwise it would be root's and the worker could not write.
ARG APP_UID=10001
RUN groupadd --system --gid "${APP_UID}" app \
    && useradd --system --uid "${APP_UID}" --gid app --home-dir /home/app --create-home \
        --shell /usr/sbin/nologin app \
    && mkdir -p /data /cache \
    && chown app:app /data /cache

COPY --from=build /opt/venv /opt/venv
# The corpus maker is not part of the installed package but is handy inside the container:
#   docker compose run --rm --entrypoint python worker /app/scripts/make_corpus.py --out ...
COPY scripts/make_corpus.py /app/scripts/make_corpus.py

# HF_HUB_OFFLINE: the default model ships inside a Python package, so nothing needs a
# model hub; set HF_HUB_OFFLINE=0 at run time to let --model name a hub model.
# HF_HOME/TORCH_HOME/XDG_CACHE_HOME: every cache goes to /cache, which compose mounts as
# a volume, so that a model fetched or compiled once is kept across containers.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/cache/huggingface \
    TORCH_HOME=/cache/torch \
    XDG_CACHE_HOME=/cache

# No VOLUME instruction: it would leave an anonymous volume behind every `docker run`
# (even `--help`); docker-compose.yml mounts named volumes on /data and /cache instead.
USER app
WORKDIR /data

# `pipeline run` handles SIGTERM itself (finishes or drops the batch in flight, exits 0).
STOPSIGNAL SIGTERM
ENTRYPOINT ["pipeline"]
CMD ["--help"]
