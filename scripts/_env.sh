# Shared by scripts/demo, scripts/test and scripts/gpu_check: pick the Python, install what is needed.
#
# - WNA16_PYTHON=/path/to/python: use that interpreter as it is (e.g. the engine's environment with its
#   CUDA or ROCm torch); the package and the test tools are installed into it, its torch is kept.
# - otherwise .venv: created with --system-site-packages when the system python3 already imports a torch
#   built for CUDA or ROCm (so that torch is used, never replaced); else a plain venv with a CPU torch
#   2.13.0 installed first, so pip never pulls a CUDA build for the `torch>=` range in pyproject.toml.
# Every pip install is constrained to the torch already present: pip fails rather than replace it.
set -euo pipefail
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: through a symlinked scripts/ too
cd "$root"

gpu_torch() {  # does interpreter $1 import a torch built for CUDA or ROCm?
  "$1" -c "import sys, torch; sys.exit(0 if (torch.version.cuda or torch.version.hip) else 1)" >/dev/null 2>&1
}

if [ -n "${WNA16_PYTHON:-}" ]; then
  py="$WNA16_PYTHON"
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "WNA16_PYTHON=$py cannot import torch: install the CUDA/ROCm (or CPU) torch you want into it first" >&2
    exit 1
  fi
  stamp="$("$py" -c "import sys; print(sys.prefix)")/.wna16-installed-$(echo "$root" | cksum | cut -d' ' -f1)"
else
  if [ ! -x .venv/bin/python ]; then
    if command -v python3 >/dev/null && gpu_torch python3; then
      echo "installing: using the system's GPU torch: creating .venv with --system-site-packages" >&2
      python3 -m venv --system-site-packages .venv
    else
      echo "installing: creating .venv (first run only)..." >&2
      python3 -m venv .venv
    fi
  elif ! gpu_torch .venv/bin/python && command -v python3 >/dev/null && gpu_torch python3; then
    echo "warning: python3 imports a CUDA/ROCm torch but .venv has a CPU one; remove .venv to use the GPU" >&2
  fi
  py=.venv/bin/python
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "installing: torch 2.13.0 (CPU) into .venv..." >&2
    "$py" -m pip install -q "torch==2.13.0"
  fi
  stamp=.venv/.wna16-installed
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing: wna16_loader and its test tools (pip install -e '.[test]') into $py..." >&2
  keep="$(mktemp)"
  "$py" -c "import torch; print('torch==' + torch.__version__)" >"$keep" 2>/dev/null  # (torch warns before numpy is in)
  if "$py" -m pip install -q -c "$keep" -e ".[test]"; then
    touch "$stamp"
    echo "installed; later runs start at once." >&2
  elif "$py" -c "import torch, safetensors, accelerate, tqdm, pytest, hypothesis" >/dev/null 2>&1; then
    echo "warning: pip could not install the package (offline?); every dependency is importable, so the" \
         "scripts run it from this checkout" >&2
  else
    rm -f "$keep"
    echo "cannot install wna16_loader's dependencies into $py (offline?): install torch, safetensors," \
         "accelerate, tqdm, pytest and hypothesis into it, then run this again" >&2
    exit 1
  fi
  rm -f "$keep"
fi
