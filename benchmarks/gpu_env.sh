# Source on the GPU machine (device tool, carry [".devpack", ".devtools"]) from the repo root: TileLang and friends
# from .devpack (../shared/tools/devpack), and the package importable without `pip install` (which the device image
# cannot do offline): deepinfer/ plus kernels/ as deepinfer.kernels, the mapping setup.py makes.
source .devpack/activate.sh
rm -rf /tmp/di && mkdir -p /tmp/di/deepinfer && cp -r deepinfer/* /tmp/di/deepinfer/ \
  && cp -r kernels /tmp/di/deepinfer/kernels && cp -r conf /tmp/di/deepinfer/conf && cp -r recipes /tmp/di/deepinfer/recipes
export PYTHONPATH=/tmp/di${PYTHONPATH:+:$PYTHONPATH}
export GPU_TESTS="$PWD/tests/gpu"
