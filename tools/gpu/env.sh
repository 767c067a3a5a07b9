# Sourced on the device machine from the checkout's root after tools/gpu/pack.sh filled .gpu/ here: installs the
# wheels, unpacks MNIST and the Inception network, and defines
#   q NAME [quality.py args...]   one benchmarks/quality.py call, its output in $OUT/q/NAME.out
#   left, rest                    tools/gpu/base.sh's clock
#   pack                          the quality reports and each run's logs into $OUT/q.tar
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" .gpu/whl/*.whl
export PYTHONPATH="$S:$PWD"
source tools/gpu/base.sh
D=/tmp/data; I=/tmp/inception-fp16.pt
if [ ! -s $D/MNIST/raw/t10k-images-idx3-ubyte ]; then
  mkdir -p $D/MNIST/raw
  for f in .gpu/mnist/*.gz; do gunzip -c "$f" > $D/MNIST/raw/$(basename "$f" .gz); done
fi
[ -s $I ] || xz -dc .gpu/inception-fp16.pt.xz > $I
mkdir -p runs/q runs/qout $OUT/q
q() { local name=$1; shift; echo "== $name $(left)"
  python benchmarks/quality.py --data-root $D --inception $I --work runs/q --out runs/qout --weights ema0.99 \
    --flow-map-error 256 "$@" > $OUT/q/$name.out 2>&1; echo "rc=$? $(left)"; tail -n 12 $OUT/q/$name.out; }
# every evaluation's json reaches $OUT within 20 s of being written, so a call cut by its limit keeps them; the copier
# ends with the calling shell and holds none of its output (disowned: a plain `wait` does not wait for it)
mkdir -p $OUT/q/qout
( while kill -0 $$ 2>/dev/null && sleep 20; do cp runs/qout/*.json $OUT/q/qout/ 2>/dev/null; done ) > /dev/null 2>&1 < /dev/null & disown
pack() { cp -r runs/qout $OUT/q/ 2>/dev/null; for r in runs/q/*/; do n=$(basename $r); mkdir -p $OUT/q/runs/$n;
  cp $r/*.log $r/*.jsonl $r/*.yaml $OUT/q/runs/$n/ 2>/dev/null; done; tar -cf $OUT/q.tar -C $OUT q && rm -rf $OUT/q; }
