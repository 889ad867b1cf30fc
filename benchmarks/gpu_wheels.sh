#!/usr/bin/env bash
# The wheels the device machine lacks for the whole suite, for `carry: [".whl"]`.
# Run here, in the repository root, before the GPU call (about 30 s, 16 MB):
#     bash benchmarks/gpu_wheels.sh
# The device machine (Python 3.12, x86-64, no network) has JAX, Flax, optax, Equinox,
# chex, diffrax, optimistix, lineax, hypothesis, pytest-xdist and PyTorch, but not
# Haiku and Keras (tests/behaviour/test_integrations.py, tests/behaviour/test_stateful_modules.py) or
# pytest-examples (tests/repository/test_docs.py: the README's and docs' code). These are
# they, each with what it needs that the machine lacks (KINDS.md lists what it has).
# benchmarks/gpu_session.py installs ./.whl/*.whl into /tmp when the folder is there.
# Not carried: nbclient/ipykernel and mkdocs (the notebook and site tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  dm-haiku==0.0.17 jmp==0.0.4 keras==3.15.1 namex==0.1.0 optree==0.20.0 \
  pytest-examples==0.0.18 black==26.10.1 pytokens==0.4.1 platformdirs==4.14.8 ruff==0.17.6
ls .whl
