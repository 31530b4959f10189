# Source on the GPU machine (device tool, carry [".devpack"]) from the repo root: TileLang and friends
# from .devpack (../shared/tools/devpack), and the package importable without `pip install` (which the device image
# cannot do offline): deepinfer/ plus kernels/ as deepinfer.kernels, the mapping setup.py makes, in a fresh temp dir.
source .devpack/activate.sh
DEEPINFER_SITE=$(mktemp -d) && mkdir -p "$DEEPINFER_SITE/deepinfer" && cp -r deepinfer/* "$DEEPINFER_SITE/deepinfer/" \
  && cp -r kernels conf recipes "$DEEPINFER_SITE/deepinfer/"
export DEEPINFER_SITE PYTHONPATH="$DEEPINFER_SITE${PYTHONPATH:+:$PYTHONPATH}"
export GPU_TESTS="$PWD/tests/gpu"
