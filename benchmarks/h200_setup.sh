#!/usr/bin/env bash
# Source this on the GPU machine: installs the staged wheels it lacks and the project (no network there).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . ./tests/dummy_plugin >/dev/null 2>&1 || echo "editable install failed" >&2
export SPECTER_CACHE=/tmp/specter-cache
