#!/usr/bin/env bash
# attn-pending (.attnp, rebased on main + token-meta, its own prebuild) vs main (this tree):
# attn_probe and bench_e2e alternating, then the policy at 1 x 1k (full p grid) on main
set -u
O=$OUT; t0=$(date +%s); root=$PWD; nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.decompress(open(sys.argv[1], 'rb').read()))" \
  .prebuilt/_C.cpython-312-x86_64-linux-gnu.so.xz dflash_ops/_C.cpython-312-x86_64-linux-gnu.so
(cd .attnp && OUT=$O/c OLD_DIR=$root COMPARE_SUITES="attn e2e" OLD_COMMIT=main DFLASH_OPS_COMMIT=attn-pending \
  ROUND_BUDGET_S=${RB:-250} bash benchmarks/gpu_check.sh compare)
echo "compare: $(( $(date +%s) - t0 )) s"
if [ $(( $(date +%s) - t0 )) -lt ${POL_AFTER:-380} ]; then
  DFLASH_OPS_BENCH_POLICY_CASES=1x1k PYTHONPATH=$root DFLASH_OPS_COMMIT=main timeout 150 \
    python3 -m dflash_ops bench policy --out $O/pol > $O/pol_1x1k.log 2>&1
  grep -E "^\[policy\]|verdict" $O/pol_1x1k.log | tail -8
fi
cd $O && tar czf /tmp/c4.tgz . && find . -mindepth 1 -delete && mv /tmp/c4.tgz call4.tgz
echo "total: $(( $(date +%s) - t0 )) s"
