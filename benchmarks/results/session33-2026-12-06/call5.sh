#!/usr/bin/env bash
# attn-pending's split: main (this tree) vs attn-pending (.attnp: triggers + loader) vs
# attn-pending-a (.attna: triggers alone), attn_probe and bench_e2e --quick, alternating, twice
set -u
O=$OUT; t0=$(date +%s); root=$PWD; nvidia-smi --query-gpu=name --format=csv,noheader
OP_CHECK=0 OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; tail -2 $O/build.log
for d in .attnp .attna; do
  python3 -c "import lzma,sys;open(sys.argv[2],'wb').write(lzma.decompress(open(sys.argv[1],'rb').read()))" \
    $d/.prebuilt/_C.cpython-312-x86_64-linux-gnu.so.xz $d/dflash_ops/_C.cpython-312-x86_64-linux-gnu.so
done
echo "prep: $(( $(date +%s) - t0 )) s"
for r in 1 2; do
  [ $r = 2 ] && [ $(( $(date +%s) - t0 )) -gt ${R2_AFTER:-300} ] && { echo "no round 2"; break; }
  for side in main:. pending:.attnp a:.attna; do
    n=${side%%:*}; d=${side#*:}
    (cd $d && PYTHONPATH=$PWD timeout 120 python3 $root/benchmarks/attn_probe.py > $O/attn_${n}_$r.log 2>&1)
    (cd $d && PYTHONPATH=$PWD DFLASH_OPS_COMMIT=$n timeout 200 python3 benchmarks/bench_e2e.py --quick --no-plot \
       --out $O/e-$n-$r > $O/e2e_${n}_$r.log 2>&1)
    echo "== $n round $r: $(( $(date +%s) - t0 )) s"; grep -E "^\| (1|8|32) x" $O/attn_${n}_$r.log | head -9
    grep -E "^\[e2e\] B=" $O/e2e_${n}_$r.log | cut -c1-110
  done
done
cd $O && tar czf /tmp/c5.tgz . && find . -mindepth 1 -delete && mv /tmp/c5.tgz call5.tgz
echo "total: $(( $(date +%s) - t0 )) s"
