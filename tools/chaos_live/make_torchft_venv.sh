#!/usr/bin/env bash
# Scratch venv with torchft for tools/chaos_live/torchft_baseline.py (not part of make test;
# torchft is not a phalanx dependency). Every install is --no-deps so that pip never pulls a
# CUDA torch: the venv sees the CPU torch of the repo's .venv through a .pth file.
#
#   bash tools/chaos_live/make_torchft_venv.sh [VENV] [PACKAGE]
#
# BASE_PY (default: this checkout's .venv/bin/python) is the interpreter whose torch is reused;
# from a worktree without .venv: BASE_PY=/work/main/.venv/bin/python bash ...
# VENV defaults to /work/tftvenv, PACKAGE to torchft==0.2.0 (torchft-nightly also works: its
# DDP comm hook survives a replica killed during the gradient all-reduce, 0.2.0's does not).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BASE_PY="${BASE_PY:-$ROOT/.venv/bin/python}"
VENV="${1:-/work/tftvenv}"
PACKAGE="${2:-torchft==0.2.0}"

"$BASE_PY" -m venv "$VENV"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE_SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$BASE_SITE" >"$SITE/zz_base_venv.pth"

PIP=("$VENV/bin/pip" install --no-deps)
"${PIP[@]}" "$PACKAGE"
# torchft's requirements (opentelemetry exporter, sdk, api) and theirs, pinned as they pin them.
"${PIP[@]}" opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
    opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
    opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
    googleapis-common-protos requests urllib3 idna charset-normalizer certifi
# protobuf and typing-extensions come from the base venv; check that they do.
"$VENV/bin/python" -c 'import google.protobuf, typing_extensions, torch, torchft; print("torchft ok, torch", torch.__version__)'
"$VENV/bin/torchft_lighthouse" --help >/dev/null
