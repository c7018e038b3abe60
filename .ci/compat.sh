#!/usr/bin/env bash
# The compat stage: the peers' own client packages, pinned, against a live kvrunner serve
# (tests/compat). Each goes into a site directory of its own with --no-deps, so nothing
# in the environment (torch, transformers) is replaced.
# Usage: .ci/compat.sh [PYTHON]   (PYTHON: the interpreter with kvrunner[test] installed)
set -euo pipefail
PY=${1:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SITE=${KVRUNNER_COMPAT_SITE:-$ROOT/.compat-site}
"$PY" -m pip install -q --no-deps --target "$SITE" trl==1.16.0
cd "$ROOT"
KVRUNNER_COMPAT_SITE="$SITE" PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -q -p no:cacheprovider tests/compat
