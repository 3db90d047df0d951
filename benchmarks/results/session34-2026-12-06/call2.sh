#!/usr/bin/env bash
# main (.main) vs pdl-triggers (.trig) vs attn-pending-a (.attna) vs attn-trig (this tree):
# attn_probe (main and attn-trig only: the attention kernels are attn-pending-a's in both a and at)
# and bench_e2e --quick, alternating, two rounds
set -u
O=$OUT; t0=$(date +%s); root=$PWD; nvidia-smi --query-gpu=name --format=csv,noheader
for d in .main .attna .trig; do
  ls $d/dflash_ops/_C*.so >/dev/null 2>&1 || python3 -c "import lzma,sys;open(sys.argv[2],'wb').write(lzma.decompress(open(sys.argv[1],'rb').read()))" \
    $d/.prebuilt/_C.cpython-312-x86_64-linux-gnu.so.xz $d/dflash_ops/_C.cpython-312-x86_64-linux-gnu.so
done
python3 -c "import dflash_ops._C" || OP_CHECK=0 OUT=$O/b bash benchmarks/gpu_check.sh build
echo "prep: $(( $(date +%s) - t0 )) s"
for r in 1 2; do
  [ $r = 2 ] && [ $(( $(date +%s) - t0 )) -gt ${R2_AFTER:-290} ] && { echo "no round 2"; break; }
  for side in main:.main t:.trig at:. a:.attna; do
    n=${side%%:*}; d=${side#*:}
    if [ $n = main ] || [ $n = at ]; then
      (cd $d && PYTHONPATH=$PWD timeout 120 python3 $root/benchmarks/attn_probe.py > $O/attn_${n}_$r.log 2>&1)
    fi
    (cd $d && PYTHONPATH=$PWD DFLASH_OPS_COMMIT=$n timeout 200 python3 benchmarks/bench_e2e.py --quick --no-plot \
       --out $O/e-$n-$r > $O/e2e_${n}_$r.log 2>&1)
    echo "== $n round $r: $(( $(date +%s) - t0 )) s"; grep -E "^\| (1|8|32) x" $O/attn_${n}_$r.log 2>/dev/null | head -9
    grep -E "^\[e2e\] B=" $O/e2e_${n}_$r.log | cut -c1-110
  done
done
cd $O && tar czf /tmp/c2.tgz . && find . -mindepth 1 -delete && mv /tmp/c2.tgz call2.tgz
echo "total: $(( $(date +%s) - t0 )) s"
