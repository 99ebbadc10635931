# Sourced by setup.sh, build.sh and test.sh: which LibTorch shardit is built against.
#   SHARDIT_LIBTORCH   debian (default): Debian's LibTorch 1.13 (libtorch-dev, CPU), build folder
#                      ./build.
#                      pip: PyPI's torch wheel (its CUDA build, every package pinned in
#                      scripts/torch-pip.txt), installed into a virtual environment in the build
#                      folder, build folder ./build-pip, with CUDA and NCCL on.
#   SHARDIT_BUILD_DIR  the build folder (default: as above)
#   SHARDIT_PYTHON     the Python that makes the virtual environment (default python3)
SHARDIT_LIBTORCH=${SHARDIT_LIBTORCH:-debian}
case "$SHARDIT_LIBTORCH" in
  debian) BUILD_DIR=${SHARDIT_BUILD_DIR:-build} ;;
  pip) BUILD_DIR=${SHARDIT_BUILD_DIR:-build-pip} ;;
  *)
    echo "SHARDIT_LIBTORCH=$SHARDIT_LIBTORCH: use debian (Debian's LibTorch, the default) or pip (PyPI's torch wheel)" >&2
    exit 2
    ;;
esac
TORCH_VENV="$BUILD_DIR/venv"
SHARDIT_PYTHON=${SHARDIT_PYTHON:-python3}

# The LibTorch folder inside the virtual environment's torch package (pip only).
pip_libtorch_dir() {
  local site
  site=$("$TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site/torch"
}

# The CMake arguments that build against the LibTorch of a torch wheel at $1 (its torch/ folder):
# that LibTorch, with NCCL required, and the wheel's own NCCL (nvidia-nccl beside it: its header
# and library, the NCCL its LibTorch loads), so that shardit and c10d use one NCCL.
pip_libtorch_cmake_args() {
  local torch_dir=$1 nccl_dir
  nccl_dir="$(dirname "$torch_dir")/nvidia/nccl"
  printf '%s\n' "-DSHARDIT_LIBTORCH_DIR=$torch_dir" -DSHARDIT_NCCL=ON \
    "-DSHARDIT_NCCL_INCLUDE_DIR=$nccl_dir/include" "-DSHARDIT_NCCL_LIBRARY=$nccl_dir/lib/libnccl.so.2"
}
