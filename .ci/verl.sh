#!/usr/bin/env bash
# The kvrunner-verl stage: verl 0.9.1 beside the project's torch, then the plugin's tests
# against verl's own classes on a local Ray cluster (about 1 minute on 2 cores).
#
# verl 0.9.1 pins transformers<5.11 (the project's test environment has a newer one),
# so verl and the few modules its rollout path imports go into a site directory of their
# own with --no-deps: nothing in the environment (torch, transformers) is replaced.
# Usage: .ci/verl.sh [PYTHON]   (PYTHON: the interpreter with kvrunner[test] installed)
set -euo pipefail
PY=${1:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SITE=${VERL_SITE:-$ROOT/.verl-site}
"$PY" -m pip install -q --no-deps --target "$SITE" verl==0.9.1 omegaconf hydra-core \
  antlr4-python3-runtime==4.9.3 tensordict==0.10.0 codetiming pyvers lazy-importer cloudpickle \
  orjson cachetools pillow datasets multiprocess pandas python-dateutil pyarrow dill xxhash
"$PY" -c "import torch; print('torch', torch.__version__)"
cd "$ROOT"
PYTHONPATH="$ROOT/integrations/verl:$SITE${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -q -p no:cacheprovider integrations/verl/tests
