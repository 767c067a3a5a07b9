# Fewer kernel-launching ops in an eager step (docs/train_step.md, sixty-first day): trainer.bulk_casts, the adaLN
# norms' two gradients reduced together, and every block's adaLN modulation in one matmul (fnn.linears). tests.sh's
# gpu tests (~105 s), then the eager and graphed DiT-B/2 steps of the tree before the change (.base/, carried) and of
# this one, each with --casts each and bulk, each its own process, in the order A B C D D C B A while time is left.
#   mkdir -p .base && git archive BASE flm benchmarks | tar -x -C .base   # BASE: 2fa86e9, before the change
#   LIMIT=SECONDS [VARIANTS="base:each new:bulk ..."] [EXEC=eager,graph] bash tools/gpu/ops.sh   (carry [".gpu", ".base"])
# Other A/B comparisons of two trees take the same loop with their own VARIANTS (TREE:CASTS, in order) and EXEC.
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
bash tools/gpu/tests.sh
n=0
for variant in ${VARIANTS:-base:each base:bulk new:each new:bulk new:bulk new:each base:bulk base:each}; do
  [ $(rest) -gt 75 ] || break
  tree=${variant%%:*}; casts=${variant#*:}; root=$PWD; [ $tree = base ] && root=$PWD/.base; n=$((n + 1))
  echo "== $n $tree --casts $casts $(left)"
  timeout $(( $(rest) - 10 )) env PYTHONPATH=$S:$root python $root/benchmarks/train_step.py --models DiT-B/2 \
    --tokens 1024 --objectives flow_matching,meanflow,scm --backends triton_jvp --modes dual --exec ${EXEC:-eager,graph} \
    --rounds 2 --casts $casts > $OUT/ops_${n}_${tree}_$casts.log 2>&1
  echo "rc=$? $(left)"; grep -E "^\| DiT" $OUT/ops_${n}_${tree}_$casts.log
done
echo "end $(left)"
