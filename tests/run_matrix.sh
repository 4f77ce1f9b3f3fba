#!/usr/bin/env bash
# Runs the test matrix: hatch's `test` matrix, one environment per package (only that package and its declared
# dependencies installed), each running its own tests; `server` also runs the cross-package tests. Fails if any
# environment fails or collects no test. The first package's tests run in the background beside the others'
# (OMNI_MATRIX_SERIAL=1: one after another).
# Usage: bash tests/run_matrix.sh [PACKAGE ...]   (default: every value of the matrix, in hatch.toml's order)
#        bash tests/run_matrix.sh --lint          the lint and format gate only (ruff check + ruff format --check)
#
# On a fresh machine it first installs what is missing: hatch (into .ci-venv, from PyPI) and, on Debian, the
# packages the suite needs (python3-venv for that venv; chromium and chromium-driver for the playground test),
# through apt-get as root or with passwordless sudo.
set -uo pipefail
cd "$(dirname "$0")/.."

MIN_HATCH=1.18  # workspace members in matrix overrides

apt_install() {  # apt_install PACKAGE...: install Debian packages, or say what to run and fail
  local run=()
  if [ "$(id -u)" -ne 0 ]; then
    if ! sudo -n true 2>/dev/null; then
      echo "missing: $*; install them (apt-get install $*) or rerun as root" >&2
      return 1
    fi
    run=(sudo -n)
  fi
  if ! command -v apt-get >/dev/null; then
    echo "missing: $* (the Debian package names); install their equivalents with your package manager" >&2
    return 1
  fi
  echo "installing $* (apt-get)"
  "${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    "${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

hatch_is_recent() {
  local version
  version=$(hatch --version 2>/dev/null | awk '{print $NF}') || return 1
  [ -n "$version" ] && [ "$(printf '%s\n%s\n' "$MIN_HATCH" "$version" | sort -V | head -1)" = "$MIN_HATCH" ]
}

ensure_hatch() {
  if command -v hatch >/dev/null && hatch_is_recent; then
    return 0
  fi
  if [ -x .ci-venv/bin/hatch ]; then
    export PATH="$PWD/.ci-venv/bin:$PATH"
    hatch_is_recent && return 0
  fi
  if ! python3 -c "import ensurepip, venv" 2>/dev/null; then
    apt_install python3-venv || return 1
  fi
  echo "installing hatch>=$MIN_HATCH into .ci-venv"
  python3 -m venv .ci-venv &&
    .ci-venv/bin/python -m pip install -q --disable-pip-version-check "hatch>=$MIN_HATCH" || return 1
  export PATH="$PWD/.ci-venv/bin:$PATH"
}

ensure_chromium() {  # headless Chromium and its driver, for the playground page test
  if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    return 0
  fi
  apt_install chromium chromium-driver
}

ensure_hatch || { echo "FAILED: could not install hatch" >&2; exit 1; }

if [ "${1:-}" = "--lint" ]; then
  echo "=== lint ==="
  hatch run lint:check || { echo "FAILED: lint (ruff check / ruff format --check)" >&2; exit 1; }
  exit 0
fi

packages=("$@")
if [ ${#packages[@]} -eq 0 ]; then
  # The matrix's values, in order, from hatch itself (environment names are `test.<package>`).
  mapfile -t packages < <(hatch env show --json | python3 -c \
    'import json, sys; print("\n".join(n.split(".", 1)[1] for n in json.load(sys.stdin) if n.startswith("test.")))')
fi

failed=()
summary=()
if printf '%s\n' "${packages[@]}" | grep -qx server && ! ensure_chromium; then
  failed+=("test.server (chromium)")
  mapfile -t packages < <(printf '%s\n' "${packages[@]}" | grep -vx server)
fi

# Building an environment is mostly unpacking wheels, testing is mostly CPU: two background jobs build the
# environments (every other one each, in test order, so the two longest suites' environments come first, side by
# side) while the tests of those already built run. pip does not byte-compile what it installs
# (PIP_NO_COMPILE): compiling the modules of torch, vLLM, transformers and diffusers alone takes 31 s of CPU per
# environment here, and the tests import a fraction of them (compiled on first import). Each build leaves PACKAGE.ok or
# PACKAGE.failed (with PACKAGE.log) in $built.
built=$(mktemp -d)
build_every_other() {  # build_every_other START: build packages START, START+2, ...
  local i
  for ((i = $1; i < ${#packages[@]}; i += 2)); do
    if PIP_NO_COMPILE=1 hatch -q env create "test.${packages[i]}" >"$built/${packages[i]}.log" 2>&1; then
      touch "$built/${packages[i]}.ok"
    else
      touch "$built/${packages[i]}.failed"
    fi
  done
}
build_every_other 0 &
builder=$!
build_every_other 1 &
builder="$builder $!"
trap 'kill $builder ${tester:-} 2>/dev/null; rm -rf "$built"' EXIT

run_tests() {  # run_tests PACKAGE: wait for its environment, run its tests; leaves PACKAGE.result ("rc seconds")
  local package=$1 start=$SECONDS rc
  echo "=== test.${package} ==="
  while [ ! -e "$built/${package}.ok" ] && [ ! -e "$built/${package}.failed" ]; do
    sleep 1
  done
  if [ -e "$built/${package}.failed" ]; then
    cat "$built/${package}.log"
    echo "env $((SECONDS - start))" >"$built/${package}.result"
    return
  fi
  hatch run "+package=${package}" test:run -q -p no:cacheprovider --durations=15
  rc=$?
  echo "$rc $((SECONDS - start))" >"$built/${package}.result"
}

# The first package (the longest: the server's tests, which wait on server processes much of the time) runs in
# the background beside the others, which run one after another; its output is printed when it ends.
# OMNI_MATRIX_SERIAL=1 runs every package one after another.
background=()
rest=("${packages[@]}")
if [ "${OMNI_MATRIX_SERIAL:-0}" != 1 ] && [ ${#packages[@]} -gt 1 ]; then
  background=("${packages[0]}")
  rest=("${packages[@]:1}")
  run_tests "${packages[0]}" >"$built/${packages[0]}.out" 2>&1 &
  tester=$!
fi
for package in "${rest[@]}"; do
  run_tests "$package"
done
if [ ${#background[@]} -ne 0 ]; then
  wait "$tester"
  cat "$built/${background[0]}.out"
fi
for package in "${packages[@]}"; do
  read -r rc took <"$built/${package}.result"
  if [ "$rc" = env ]; then
    failed+=("test.${package} (environment)")
    continue
  elif [ "$rc" -eq 5 ]; then
    failed+=("test.${package} (no tests collected)")
  elif [ "$rc" -ne 0 ]; then
    failed+=("test.${package} (pytest exit ${rc})")
  fi
  summary+=("test.${package}: exit ${rc}, ${took}s (with the wait for its environment)")
done

echo "=== matrix summary ==="
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -ne 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all ${#packages[@]} environments passed"
