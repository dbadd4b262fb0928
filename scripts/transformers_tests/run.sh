#!/usr/bin/env bash
# Run transformers' model tests (GPT-2, Llama, Mistral, Gemma-2, BERT) stock and with
# attnlab as their attention, then compare.  See docs/transformers-tests.md.
#
#   scripts/transformers_tests/run.sh [MODEL ...]      # default: gpt2 llama mistral gemma2 bert
#
# Environment (all optional):
#   PYTHON        interpreter with torch + transformers==5.23.0 + pytest (default: python)
#   WORK          scratch folder, never committed (default: <repo>/scratch/transformers_tests)
#   ATTNLAB_SRC   attnlab source folder put first on PYTHONPATH (default: <repo>/src)
#   RESULTS       results folder (default: $WORK/results); compare.py reads stock from it too
#   STOCK_RESULTS where compare.py reads the stock runs from (default: $RESULTS)
#   MODES         "stock attnlab" (default), or one of them
#   TIMEOUT       per-test timeout in s when pytest-timeout is installed (default 300)
#   MARKERS       pytest -m expression (default: deselect the multi-process FSDP / tensor- / expert-parallel
#                 tests, which need tests/distributed_testing_utils.py, absent from the sdist)
#   PYTEST_ARGS   extra pytest arguments, e.g. '-k "not compile"'
#   TF_VERSION    transformers sdist to take the shared test mixins from (default 5.23.0)
#
# The test tree is laid out in $WORK/tree/tests:
#   * tests/*.py (test_modeling_common.py, test_configuration_common.py, test_pipeline_mixin.py,
#     test_training_mixin.py, ...) from the transformers $TF_VERSION sdist, downloaded with
#     `pip download transformers==$TF_VERSION --no-binary :all: --no-deps` unless already in $WORK/sdist;
#   * the files the sdist lacks (tests/causal_lm_tester.py, tests/generation/test_utils.py,
#     tests/exporters/test_export.py, tests/utils/test_configuration_utils.py and the five
#     tests/models/<m>/test_modeling_<m>.py) from vendor/, copied unchanged from upstream tag v5.15.0.
# Results: $RESULTS/<model>-<mode>.xml (JUnit), .log, and calls-<model>.json (attnlab calls per module).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python}"
WORK="${WORK:-$REPO/scratch/transformers_tests}"
MODES="${MODES:-stock attnlab}"
ATTNLAB_SRC="${ATTNLAB_SRC:-$REPO/src}"
RESULTS="${RESULTS:-$WORK/results}"
TIMEOUT="${TIMEOUT:-300}"
TF_VERSION="${TF_VERSION:-5.23.0}"
MARKERS="${MARKERS:-not is_fsdp_test and not is_tensor_parallel_test and not is_expert_parallel_test}"
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(gpt2 llama mistral gemma2 bert)

have=$("$PYTHON" -c "import transformers; print(transformers.__version__)")
[ "$have" = "$TF_VERSION" ] || echo "warning: transformers $have installed, test mixins taken from $TF_VERSION" >&2

mkdir -p "$WORK/sdist" "$RESULTS"
sdist="$WORK/sdist/transformers-$TF_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  "$PYTHON" -m pip download "transformers==$TF_VERSION" --no-binary :all: --no-deps -d "$WORK/sdist"
fi
TREE="$WORK/tree"
if [ ! -f "$TREE/.laid-out-$TF_VERSION" ]; then
  rm -rf "$TREE" && mkdir -p "$TREE"
  tar xzf "$sdist" -C "$TREE" --strip-components=1 "transformers-$TF_VERSION/tests"
  # vendor/ only adds files the sdist does not ship; never overwrite a sdist file
  (cd "$HERE/vendor" && find tests utils -type f) | while read -r f; do
    if [ ! -e "$TREE/$f" ]; then mkdir -p "$TREE/$(dirname "$f")" && cp "$HERE/vendor/$f" "$TREE/$f"; fi
  done
  # stubs/ fills the two files neither source has (see their headers), again without overwriting
  (cd "$HERE/stubs" && find tests -type f) | while read -r f; do
    if [ ! -e "$TREE/$f" ]; then cp "$HERE/stubs/$f" "$TREE/$f"; fi
  done
  cat > "$TREE/pytest.ini" <<'INI'
[pytest]
# from transformers' pyproject.toml [tool.pytest.ini_options] (markers only)
markers =
    all_flash_attn_test
    flash_attn_4_test
    flash_attn_3_test
    flash_attn_test
    bitsandbytes
    generate
    is_training_test
    is_tensor_parallel_test
    is_expert_parallel_test
    is_fsdp_test
    torch_compile_test
    torch_export_test
    slow
    onnx_export_test
    executorch_export_test
    timeout
    accelerate_tests
filterwarnings =
    ignore::DeprecationWarning
    ignore::FutureWarning
INI
  # test_pipeline_mixin.py imports <root>/src/transformers by path: point it at the installed package
  mkdir -p "$TREE/src"
  ln -sfn "$("$PYTHON" -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')" "$TREE/src/transformers"
  touch "$TREE/.laid-out-$TF_VERSION"
fi

# test-only dependencies the model tests import, installed into $WORK/pydeps (not the venv)
DEPS="$WORK/pydeps"
for dep in parameterized; do
  if ! PYTHONPATH="$DEPS" "$PYTHON" -c "import $dep" 2>/dev/null; then
    "$PYTHON" -m pip install -q --target "$DEPS" "$dep"
  fi
done

eval "extra=(${PYTEST_ARGS:-})"   # shell words, so -m "not a and not b" stays one argument
timeout_args=()
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then timeout_args=(--timeout="$TIMEOUT"); fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false
unset RUN_SLOW || true   # @slow tests skip themselves

cd "$TREE"
for m in "${MODELS[@]}"; do
  f="tests/models/$m/test_modeling_$m.py"
  for mode in $MODES; do
    plugin=()
    pp="$ATTNLAB_SRC:$DEPS"
    eager=0
    if [ "$mode" = attnlab ]; then
      plugin=(-p attnlab_plugin)
      pp="$ATTNLAB_SRC:$DEPS:$HERE"
      [ "$m" = gemma2 ] && eager=1   # Gemma-2 has _supports_sdpa = False: route "eager" too
    fi
    echo "== $m $mode"
    set +e
    PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}" ATTNLAB_ROUTE_EAGER=$eager \
      ATTNLAB_CALLS_JSON="$RESULTS/calls-$m.json" \
      "$PYTHON" -m pytest "$f" -p no:cacheprovider -q -rfE "${plugin[@]}" "${timeout_args[@]}" -m "$MARKERS" \
      --junitxml="$RESULTS/$m-$mode.xml" "${extra[@]}" > "$RESULTS/$m-$mode.log" 2>&1
    echo "   exit $?; $(tail -n 1 "$RESULTS/$m-$mode.log")"
    set -e
  done
done
"$PYTHON" "$HERE/compare.py" --stock "${STOCK_RESULTS:-$RESULTS}" "$RESULTS" "${MODELS[@]}"
