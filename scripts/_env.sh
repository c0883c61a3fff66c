# Shared by scripts/demo and scripts/test: create .venv and install what is needed.
# A CPU torch 2.13.0 is installed first when no torch is importable, so pip never
# pulls a CUDA build for the `torch>=` range in pyproject.toml.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
  echo "installing: creating .venv (first run only; about 30 s)..." >&2
  python3 -m venv .venv
fi
py=.venv/bin/python
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  echo "installing: torch 2.13.0 (CPU) into .venv..." >&2
  "$py" -m pip install -q "torch==2.13.0"
fi
stamp=.venv/.wna16-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing: wna16_loader and its test tools into .venv (pip install -e '.[test]')..." >&2
  "$py" -m pip install -q -e ".[test]"
  touch "$stamp"
  echo "installed; next runs start at once." >&2
fi
