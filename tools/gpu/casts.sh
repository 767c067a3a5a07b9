# trainer.bulk_casts on a GPU (docs/train_step.md, sixtieth day): its gpu tests, then the eager and graphed steps with
# the parameters' casts one per parameter (each) and in bulk, each kind its own process, alternating, twice.
#   LIMIT=SECONDS bash tools/gpu/casts.sh   (carry [".gpu"]: the tests' teacher runs train.py, which needs hydra)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
timeout 150 python -m pytest -q -m gpu tests/train/test_distill.py -k bulk_casts --tb=short > $OUT/casts_tests.log 2>&1
echo "gpu tests rc=$? $(left)"; tail -n 3 $OUT/casts_tests.log
for round in 1 2; do
  for casts in each bulk; do
    [ $(rest) -gt 90 ] || break 2
    echo "== round $round, --casts $casts $(left)"
    timeout $(( $(rest) - 20 )) python benchmarks/train_step.py --models DiT-B/2 --tokens 1024 \
      --objectives meanflow,scd --backends triton_jvp --modes dual --no-sdpa-baseline --exec eager,graph \
      --casts $casts > $OUT/casts_${casts}_$round.log 2>&1
    echo "rc=$? $(left)"; grep -E "^\| DiT" $OUT/casts_${casts}_$round.log
  done
done
echo "end $(left)"
