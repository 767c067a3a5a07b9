# Issue 16: the eager step with flm.nn's old-style twins (no argument binding per Function call) against the tree
# before them. tests.sh's gpu tests first, then the eager DiT-B/2 steps of both trees, each its own process, in the order
# A B B A while time is left (the host's speed drifts within minutes).
#   mkdir -p .base && git archive BASE flm benchmarks | tar -x -C .base   # BASE: 6b9cb6f, before the twins
#   LIMIT=SECONDS bash tools/gpu/twins.sh   (carry [".gpu", ".base"])
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
bash tools/gpu/tests.sh
n=0
for tree in base new new base base new; do
  [ $(rest) -gt 60 ] || break
  root=$PWD; [ $tree = base ] && root=$PWD/.base; n=$((n + 1))
  echo "== $n $tree $(left)"
  timeout $(( $(rest) - 10 )) env PYTHONPATH=$S:$root python $root/benchmarks/train_step.py --models DiT-B/2 \
    --tokens 1024 --objectives flow_matching,meanflow,scm --backends triton_jvp --modes dual --exec eager \
    --rounds 2 --no-sdpa-baseline > $OUT/twins_${n}_$tree.log 2>&1
  echo "rc=$? $(left)"; grep -E "^\| DiT" $OUT/twins_${n}_$tree.log
done
echo "end $(left)"
