#!/usr/bin/env bash
# H200 (needs_h200: on the H100 8 x 32k was skipped, caches 50 GB + steps 17 GB > 65 GB free):
# the 8 x 32k policy case on main (.main); then, while time is left, main vs attn-trig (this
# tree) on the H200: bench_e2e --quick and attn_probe, one round each
set -u
O=$OUT; t0=$(date +%s); root=$PWD; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for d in .main; do
  python3 -c "import lzma,sys;open(sys.argv[2],'wb').write(lzma.decompress(open(sys.argv[1],'rb').read()))" \
    $d/.prebuilt/_C.cpython-312-x86_64-linux-gnu.so.xz $d/dflash_ops/_C.cpython-312-x86_64-linux-gnu.so
done
(cd .main && OP_CHECK=0 OUT=$O/q POLICY_EACH=8x32k POLICY_TIMEOUT=${T1:-380} DFLASH_OPS_COMMIT=main \
    bash benchmarks/gpu_check.sh policy)
echo "policy: $(( $(date +%s) - t0 )) s"
OP_CHECK=0 OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; tail -1 $O/build.log
for side in main:.main at:.; do
  [ $(( $(date +%s) - t0 )) -gt ${CMP_AFTER:-470} ] && { echo "no time for $side"; break; }
  n=${side%%:*}; d=${side#*:}
  (cd $d && PYTHONPATH=$PWD timeout 60 python3 $root/benchmarks/attn_probe.py > $O/attn_${n}.log 2>&1)
  (cd $d && PYTHONPATH=$PWD DFLASH_OPS_COMMIT=$n timeout 100 python3 benchmarks/bench_e2e.py --quick --no-plot \
     --out $O/e-$n > $O/e2e_${n}.log 2>&1)
  echo "== $n: $(( $(date +%s) - t0 )) s"; grep -E "^\| (1|8|32) x" $O/attn_${n}.log | head -9
  grep -E "^\[e2e\] B=" $O/e2e_${n}.log | cut -c1-110
done
cd $O && find . -type f | sort && tar czf /tmp/c4.tgz . && find . -mindepth 1 -delete && mv /tmp/c4.tgz call4.tgz
echo "total: $(( $(date +%s) - t0 )) s"
