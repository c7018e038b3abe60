#!/usr/bin/env bash
# The compat stage: the peers' own client packages, pinned, against a live kvrunner serve
# (tests/compat). Each goes into a site directory of its own with --no-deps, so nothing
# in the environment (torch, transformers) is replaced.
# Usage: .ci/compat.sh [PYTHON]   (PYTHON: the interpreter with kvrunner[test] installed)
set -euo pipefail
PY=${1:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SITE=${KVRUNNER_COMPAT_SITE:-$ROOT/.compat-site}
AREAL_SITE=${KVRUNNER_COMPAT_AREAL_SITE:-$ROOT/.compat-site-areal}
"$PY" -m pip install -q --no-deps --target "$SITE" trl==1.16.0
# AReaL's RemoteSGLangEngine imports its config, name service and workflow modules:
# these are the packages that import chain needs beyond the test environment
"$PY" -m pip install -q --no-deps --target "$AREAL_SITE" areal==1.0.4 \
  aiofiles==25.1.0 antlr4-python3-runtime==4.9.3 blinker==1.9.0 colorlog==6.12.0 \
  einops==0.8.2 flask==3.1.3 hydra-core==1.3.8 itsdangerous==2.2.0 lark==1.3.1 \
  llvmlite==0.50.0 numba==0.68.1 omegaconf==2.4.0 orjson==3.13.0 pillow==13.0.0 \
  pybase64==1.5.1 tenacity==9.2.1 torchdata==0.11.0 uvloop==0.23.0 werkzeug==3.1.9
cd "$ROOT"
KVRUNNER_COMPAT_SITE="$SITE" PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -q -p no:cacheprovider tests/compat --ignore=tests/compat/test_areal_remote_engine.py
KVRUNNER_COMPAT_SITE="$AREAL_SITE" PYTHONPATH="$AREAL_SITE${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -q -p no:cacheprovider tests/compat/test_areal_remote_engine.py
