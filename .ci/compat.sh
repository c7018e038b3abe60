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
VERIFIERS_SITE=${KVRUNNER_COMPAT_VERIFIERS_SITE:-$ROOT/.compat-site-verifiers}
"$PY" -m pip install -q --no-deps --target "$SITE" trl==1.16.0
# AReaL's RemoteSGLangEngine imports its config, name service and workflow modules:
# these are the packages that import chain needs beyond the test environment
"$PY" -m pip install -q --no-deps --target "$AREAL_SITE" areal==1.0.4 \
  aiofiles==25.1.0 antlr4-python3-runtime==4.9.3 blinker==1.9.0 colorlog==6.12.0 \
  einops==0.8.2 flask==3.1.3 hydra-core==1.3.8 itsdangerous==2.2.0 lark==1.3.1 \
  llvmlite==0.50.0 numba==0.68.1 omegaconf==2.4.0 orjson==3.13.0 pillow==13.0.0 \
  pybase64==1.5.1 tenacity==9.2.1 torchdata==0.11.0 uvloop==0.23.0 werkzeug==3.1.9
# verifiers' TrainClient: `verifiers.v1` imports its dialects (anthropic), sandboxes
# (prime-sandboxes over connectrpc), judges (math-verify) and configs on the way, and
# the renderers registry imports every renderer (gpt-oss's needs openai-harmony).
# verifiers asks for openai<3: this site's openai 2.x shadows the environment's.
"$PY" -m pip install -q --no-deps --target "$VERIFIERS_SITE" verifiers==0.4.0 \
  renderers==0.1.12 openai==2.54.0 anthropic==2.17.0 prime-pydantic-config==0.4.3 \
  prime-sandboxes==0.5.1 connectrpc==0.11.1 protobuf-py==0.1.1 pyqwest==0.12.0 \
  openai-harmony==0.0.8 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
  antlr4-python3-runtime==4.13.2 aiofiles==25.1.0 distro==1.9.0 docstring-parser==0.18.0 \
  tenacity==9.2.1 tomli-w==1.2.0
cd "$ROOT"
KVRUNNER_COMPAT_SITE="$SITE" PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -q -p no:cacheprovider tests/compat \
  --ignore=tests/compat/test_areal_remote_engine.py \
  --ignore=tests/compat/test_verifiers_train_client.py
KVRUNNER_COMPAT_SITE="$AREAL_SITE" PYTHONPATH="$AREAL_SITE${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -q -p no:cacheprovider tests/compat/test_areal_remote_engine.py
KVRUNNER_COMPAT_SITE="$VERIFIERS_SITE" PYTHONPATH="$VERIFIERS_SITE${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -q -p no:cacheprovider tests/compat/test_verifiers_train_client.py
