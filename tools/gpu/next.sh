# The next device call (docs/quality.md, "Next on the H200"), after tools/gpu/pack.sh and `git show 21153d3 > .gpu/layout.patch`:
#   LIMIT=SECONDS bash tools/gpu/next.sh   (carry [".gpu"]; LIMIT: the call's own limit, which decides what fits)
# Runs the cuDNN feed fix's gpu tests on this tree and the layout change's on a patched copy, beside the attention=auto
# teacher; then the attention=auto student of seed 1 with three EMAs, or, with too little time for the teacher, the
# graphed DiT-S/2 steps on both trees.
set -u; cd "$(dirname "$0")/../.."; source tools/gpu/env.sh
LIMIT=${LIMIT:-590}
snap() { tar -cf $OUT/qsnap.tar runs/qout $(ls -d runs/q/*/*.log runs/q/*/*.jsonl 2>/dev/null) 2>/dev/null; }
L=/tmp/lay; rm -rf $L; mkdir -p $L
tar --exclude=./runs --exclude=./.gpu -cf - . | tar -xf - -C $L
( cd $L && patch -p1 -s < $OLDPWD/.gpu/layout.patch && echo "layout patch applied" )
TS="--models DiT-S/2 --tokens 196 --batch-tokens 25088 --channels 1 --num-classes 10 --objectives flow_matching,scd,rcm --backends triton_jvp --modes dual --exec graph --iters 20"
(
  timeout 200 python -m pytest -v -m gpu tests/attention/test_cudnn_backward_gpu.py tests/attention/test_triton_jvp_gpu.py > $OUT/q/gpu_main.log 2>&1; echo "main gpu rc=$? $(left)" >> $OUT/q/gpu_main.log
  cd $L && export PYTHONPATH="${PYTHONPATH/$OLDPWD/$L}" TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) && python -c "import flm; print(flm.__file__)" >> $OUT/q/gpu_layout.log
  timeout $(( LIMIT - 160 - ($(date +%s) - T0) )) python -m pytest -v -m gpu tests/attention tests/test_fused_adaln.py tests/train/test_graphs.py tests/objectives/test_jvp_modes_gpu.py >> $OUT/q/gpu_layout.log 2>&1; echo "layout gpu rc=$? $(left)" >> $OUT/q/gpu_layout.log
) &
if [ $LIMIT -ge 540 ]; then q fmqa2 --attention auto --runs "fmqa2:flow_matching:5180:trainer.ckpt_every=4300,trainer.keep_last=0"; snap; fi
wait; echo "tests done $(left)"; tail -n 3 $OUT/q/gpu_main.log $OUT/q/gpu_layout.log; grep -c PASSED $OUT/q/gpu_layout.log; grep FAILED $OUT/q/gpu_main.log $OUT/q/gpu_layout.log | head
if [ -d runs/q/fmqa2 ] && [ $(( LIMIT - ($(date +%s) - T0) )) -gt 150 ]; then
  q rcmgqas1 --attention auto --weights ema0.99 ema0.98 ema0.995 raw --runs "rcmgqas1:rcm_gan:54s:objective.teacher=RUNS/fmqa2,trainer.seed=1,trainer.ema_decays=[0.99,0.98,0.995]"
elif [ $(( LIMIT - ($(date +%s) - T0) )) -gt 180 ]; then
  echo "== train_step main $(left)"; timeout 80 python benchmarks/train_step.py $TS > $OUT/q/train_step_main.log 2>&1; tail -n 8 $OUT/q/train_step_main.log
  echo "== train_step layout $(left)"; ( cd $L && PYTHONPATH="${PYTHONPATH/$OLDPWD/$L}" timeout 80 python benchmarks/train_step.py $TS > $OUT/q/train_step_layout.log 2>&1 ); tail -n 8 $OUT/q/train_step_layout.log
fi
pack; rm -f $OUT/qsnap.tar; echo "end $(left)"
