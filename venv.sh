#!/bin/sh
# Creates the project's virtual environment, .venv, with Python 3.12: the interpreter of the
# pinned jax (0.11.2, served for Python 3.12 and newer) and of the GPU image our GPU figures
# are measured on. Looks for python3.12 on the PATH, then under pyenv; an existing .venv of
# another Python is replaced. Then:  . .venv/bin/activate && pip install -r requirements.txt
set -eu
cd "$(dirname "$0")"
is312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
if [ -x .venv/bin/python ] && is312 .venv/bin/python; then
  exit 0
fi
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if is312 "$candidate"; then
    rm -rf .venv
    exec "$candidate" -m venv .venv
  fi
done
echo "venv.sh: no Python 3.12 found (python3.12 on the PATH or under pyenv); install one" \
     "(e.g. 'pyenv install 3.12' or your system's python3.12 package) and run it again" >&2
exit 1
