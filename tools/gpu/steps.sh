# Issue 16 on a GPU with FLM_ATTENTION_NATIVE_NODE off and on (docs/attention.md, fifty-sixth day): the eager and
# graphed DiT-B/2 steps in interleaved rounds (docs/train_step.md, Run L's second command), then the issue's 256-token
# ablation, each twice (the ablation with ablate.repeats=2: its backends in the order A B C C B A; eager steps, as the
# issue asks, with trainer.cuda_graph=false since auto became the default).
#   LIMIT=SECONDS [NODES="0 1"] bash tools/gpu/steps.sh   (carry [".gpu"]: the ablation needs hydra)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
for node in ${NODES:-0 1}; do
  [ $(rest) -gt 120 ] || break
  echo "== FLM_ATTENTION_NATIVE_NODE=$node $(left)"
  FLM_ATTENTION_NATIVE_NODE=$node timeout $(( $(rest) / 2 )) python benchmarks/train_step.py --models DiT-B/2 --tokens 1024 \
    --objectives flow_matching,meanflow,scm --backends triton_jvp --modes dual --exec eager,graph --rounds 3 \
    > $OUT/steps_node$node.log 2>&1
  echo "rc=$? $(left)"; grep -E "^\|" $OUT/steps_node$node.log | tail -n 8
done
for node in ${NODES:-0 1}; do
  [ $(rest) -gt 60 ] || break
  FLM_ATTENTION_NATIVE_NODE=$node timeout $(( $(rest) - 10 )) python ablate.py model=DiT-S/2 objective=scm \
    ablate.tokens=256 trainer.batch_size=64 trainer.max_steps=60 ablate.repeats=2 trainer.cuda_graph=false run_dir=runs/abl$node-$T0 > $OUT/ablate_node$node.log 2>&1
  echo "ablate node=$node rc=$? $(left)"; grep "^| " runs/abl$node-$T0/ablation.md || tail -n 8 $OUT/ablate_node$node.log
done
