#!/usr/bin/env bash
# Runs the test matrix: each package's tests in its own hatch environment (only that package and its declared
# dependencies installed), then the cross-package tests. Fails if any environment fails or collects no test.
# Usage: bash tests/run_matrix.sh [ENV ...]   (default: every environment, in dependency order)
set -uo pipefail
cd "$(dirname "$0")/.."

envs=("$@")
if [ ${#envs[@]} -eq 0 ]; then
  envs=(test-diffusion-kv test-dlo-offload test-fp8-cache test-cfg-pairing test-models test-server)
fi

failed=()
summary=()
for env in "${envs[@]}"; do
  echo "=== ${env} ==="
  start=$SECONDS
  hatch -q env create "${env}" || { failed+=("${env} (environment)"); continue; }
  hatch run "${env}:run" -q -p no:cacheprovider
  rc=$?
  took=$((SECONDS - start))
  if [ $rc -eq 5 ]; then
    failed+=("${env} (no tests collected)")
  elif [ $rc -ne 0 ]; then
    failed+=("${env} (pytest exit ${rc})")
  fi
  summary+=("${env}: exit ${rc}, ${took}s")
done

echo "=== matrix summary ==="
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -ne 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all ${#envs[@]} environments passed"
