# Before and after in one session: two checkouts' builds alternate, round by round (3 rounds of 2).
#   git worktree add ../before before-issue20 && (cd ../before && python setup.py build_ext --inplace)
#   BEFORE=../before NEW=. bash docs/results/before_after/run.sh && python docs/results/before_after/compare.py
# OUT (a folder for the JSON, default this one) and the trees' names (NAMES="before20 new") may be set,
# as may the sizes' step (STEP, default 4); compare.py then takes OUT and the names as well.
set -e
PY=${PY:-python}
MPIRUN=${MPIRUN:-mpirun}
BEFORE=$(cd "${BEFORE:?a built checkout of the commit before}" && pwd)
NEW=$(cd "${NEW:-.}" && pwd)
OUT=$(cd "${OUT:-$(dirname "$0")}" && pwd)
read -r NAME_BEFORE NAME_NEW <<< "${NAMES:-before20 new}"
STEP=${STEP:-4}
for round in 1 2 3; do
  for tree in $NAME_BEFORE $NAME_NEW; do
    dir=$BEFORE; [ $tree = $NAME_NEW ] && dir=$NEW
    cd "$dir"
    PYTHONPATH=$dir $MPIRUN -n 2 -x PYTHONPATH $PY -m bench all -b 1K -e 4M -f $STEP --backends engine,engine-direct,mpi4py -c 1 --rounds 2 --json "$OUT/all_${tree}_$round.json" > /dev/null
    PYTHONPATH=$dir $MPIRUN -n 2 -x PYTHONPATH $PY -m bench all_reduce -b 256K -e 64M -f 16 --backends engine,engine-direct,mpi4py -c 1 --rounds 2 --json "$OUT/ar_${tree}_$round.json" > /dev/null
    echo "$(date +%T) $tree round $round done"
  done
done
