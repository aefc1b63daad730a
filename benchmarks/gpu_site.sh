# Sourced on the GPU host before its tests and benchmarks:  source benchmarks/gpu_site.sh [CARRIED_DIR...]
# The host lacks some of Flare's dependencies (../shared/device/README.md), and one call can carry
# at most 64 MiB, so the wheels may come over several calls of one warm machine: each call installs
# the wheel folders it carries into .site/ (ignored by git, so it stays on the machine between
# calls), newer files replacing older. The project and its recipe plugins are installed editable
# without dependencies (entry points are how `flare` finds the recipes). FlashInfer's JIT kernels
# are kept in .flashinfer/ for the same reason. Fails at once if flashinfer or flare_core cannot
# be imported, before any minutes are spent.
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=$PWD/.flashinfer
mkdir -p .site "$FLASHINFER_WORKSPACE_BASE"
# A file too large for one call comes in parts (`split -b 45M FILE DIR/NAME.part`, the parts' folders
# carried by successive calls): each NAME.partXX is appended, in name order, to .site/blobs/NAME.
for carried in "$@"; do
  if compgen -G "$carried/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site "$carried"/*.whl \
      2>&1 | grep -v "WARNING: Target directory" || true
  fi
  for part in "$carried"/*.part*; do
    [ -e "$part" ] || continue
    mkdir -p .site/blobs
    blob=$(basename "$part"); blob=${blob%.part*}
    cat "$part" >> ".site/blobs/$blob"
    echo "$part appended to .site/blobs/$blob ($(stat -c %s ".site/blobs/$blob") bytes)"
  done
done
export PYTHONPATH=$PWD/.site:$PWD/tests/support${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import flare_recipe_qwen" 2>/dev/null; then
  # The host's python3 is a virtual environment (2026-12-07): an editable install goes into it.
  python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    -e . -e recipes-qwen -e recipes-deepseek -e recipes-kimi -e plugins/flare-recipe-llama
fi
python3 -c "import flashinfer, flare_core, flare_recipe_qwen, flare_recipe_deepseek, torch, transformers; \
print('site ready:', torch.cuda.get_device_name(), 'flashinfer', flashinfer.__version__, \
'transformers', transformers.__version__)"
