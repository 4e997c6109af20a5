# magus: one image for every mode (`magus <mode> …`: worker, controller, gateway, bridge,
# engine, convert, model pull). README "Container images" says how it is built and run.
#
#   buildah bud -t magus:0.1.0 .                               # the image (target `magus`)
#   buildah bud --target dllama-stand-in -t magus-dllama:stand-in .   # tests' distributed-llama
#
# The base is upstream's Node image; where no registry can be reached, scripts/images makes a
# local one under the same name and builds with --pull=never.
ARG NODE_IMAGE=docker.io/library/node:24-bookworm-slim

# Every dependency, as the lock file pins it, installed from the lock file alone: its root entry
# is package.json as far as installing goes (name, version, dependencies, engines), so an edit
# of package.json's scripts does not redo this layer.
# No install script runs: the one that matters, node-llama-cpp's, would only check (or, failing
# that, download and build) llama.cpp; its prebuilt CPU binary comes as the npm package
# @node-llama-cpp/linux-<arch>, and the engine loads it with build: 'never'.
FROM ${NODE_IMAGE} AS deps
ENV NODE_LLAMA_CPP_SKIP_DOWNLOAD=true
WORKDIR /app
COPY package-lock.json ./
RUN --mount=type=cache,target=/root/.npm \
    node -e "const fs = require('node:fs'); fs.writeFileSync('package.json', JSON.stringify(JSON.parse(fs.readFileSync('package-lock.json', 'utf8')).packages['']))" \
 && npm ci --ignore-scripts --no-audit --no-fund

# Production dependencies only, without the native builds this image never loads (GPU and
# other-platform llama.cpp builds, other platforms' Temporal core bridges: ~700 MB).
FROM deps AS prod-deps
COPY images/prune-node-modules.js /tmp/
RUN npm prune --omit=dev --ignore-scripts --no-audit --no-fund && node /tmp/prune-node-modules.js node_modules

# The TypeScript build (dist/). The build context is an allowlist (.dockerignore).
FROM deps AS build
COPY . .
RUN npm run build

# tini, to run as PID 1 where a program does not handle SIGTERM itself (dllama does not: as PID 1
# it would ignore the kubelet's SIGTERM and wait out the grace period).
FROM ${NODE_IMAGE} AS tini
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*

# A stand-in for distributed-llama, for tests where its source cannot be had:
# test/fixtures/fake-dllama.js as /usr/local/bin/dllama and dllama-api (it plays the one it is
# invoked as, and parses their flags strictly), under tini like the real image
# (images/dllama/Dockerfile). It needs the repository's TypeScript loader and the stub engine's
# sources, so it is the build stage (dev dependencies and all) plus two links. It writes to
# /tmp (SWC's native binding cache): mount an emptyDir there when the root is read-only.
FROM build AS dllama-stand-in
COPY --from=tini /usr/bin/tini-static /usr/bin/tini
RUN ln -s /app/test/fixtures/fake-dllama.js /usr/local/bin/dllama \
 && ln -s /app/test/fixtures/fake-dllama.js /usr/local/bin/dllama-api
ENV HOME=/tmp
WORKDIR /
USER 65532:65532
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["dllama-api"]

# The image: production dependencies, dist/, the CLI. Root owns every file; it runs as a
# numeric non-root user, and writes nothing outside HOME (/tmp) and the paths its flags and
# MAGUS_* variables name (MAGUS_MODEL_CACHE: a volume). `magus engine` and `magus worker` run
# with a read-only root and nothing writable (test/images.int.test.ts); give /tmp an emptyDir
# all the same, for what writes to HOME (SWC's native addon unpacks itself under HOME/.cache
# when loaded). node handles SIGTERM itself, so no init is needed.
FROM ${NODE_IMAGE} AS magus
ARG MAGUS_VERSION=unknown
LABEL org.opencontainers.image.title="magus" \
      org.opencontainers.image.version="${MAGUS_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV NODE_ENV=production \
    HOME=/tmp \
    NODE_LLAMA_CPP_SKIP_DOWNLOAD=true
WORKDIR /app
COPY --from=prod-deps /app/node_modules node_modules
COPY package.json ./
COPY bin bin
COPY crds crds
# The CLI finds its installation by this file (workers/dev/services/binaries.ts REPO_ROOT) in every mode.
COPY scripts/dev-services scripts/dev-services
COPY --from=build /app/dist dist
USER 65532:65532
ENTRYPOINT ["node", "/app/bin/magus.js"]
CMD ["--help"]
