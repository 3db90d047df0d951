#!/usr/bin/env bash
# token-meta (this tree) GPU tests, then the e2e A/B against main (.old, same csrc)
set -u
O=$OUT; t0=$(date +%s); nvidia-smi --query-gpu=name --format=csv,noheader; export OP_CHECK=0
OUT=$O/t DFLASH_OPS_COMMIT=token-meta TEST_FILES="tests/test_token_meta.py tests/test_target.py tests/test_speculator.py tests/test_drafter_gpu.py tests/test_exact_mode.py" \
  bash benchmarks/gpu_check.sh tests
echo "tests: $(( $(date +%s) - t0 )) s"
python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.decompress(open(sys.argv[1], 'rb').read()))" \
  .old/.prebuilt/_C.cpython-312-x86_64-linux-gnu.so.xz .old/dflash_ops/_C.cpython-312-x86_64-linux-gnu.so
OUT=$O/c COMPARE_SUITES=e2e OLD_COMMIT=main DFLASH_OPS_COMMIT=token-meta ROUND_BUDGET_S=${RB:-330} \
  bash benchmarks/gpu_check.sh compare
# the never-vs-plain gap at 1 x 1k (p 0 only), main then token-meta, while time is left
for side in old new; do
  [ $(( $(date +%s) - t0 )) -gt ${POL_AFTER:-470} ] && { echo "no time for policy $side"; break; }
  d=.old; [ $side = new ] && d=.
  (cd $d && PYTHONPATH=$PWD DFLASH_OPS_BENCH_POLICY_CASES=1x1k DFLASH_OPS_BENCH_POLICY_PS=0 \
    timeout 100 python3 -m dflash_ops bench policy --out $O/pol-$side > $O/pol_$side.log 2>&1)
  echo "== policy $side: $(( $(date +%s) - t0 )) s"; grep -E "never|plain|^\[policy\]" $O/pol_$side.log | tail -6
done
cd $O && tar czf /tmp/c2.tgz . && find . -mindepth 1 -delete && mv /tmp/c2.tgz call2.tgz
echo "total: $(( $(date +%s) - t0 )) s"
