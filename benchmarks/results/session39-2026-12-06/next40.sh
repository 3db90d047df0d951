#!/usr/bin/env bash
# for session 40's first call (kind nvidia-h200 without needs_h200; carry .prebuilt, .whl,
# .sk). Make .sk first, on the CPU machine:
#   rm -rf .sk && mkdir .sk && git archive streamk | tar -x -C .sk \
#     --exclude=benchmarks/results --exclude=dflash_ops/data && cp -r .prebuilt .sk/
# - an H200: session 35's call1.sh (issue 19's table, issue 17's seven attention shapes);
# - an H100: issue 16's projection (NOTES, session 39: the predictions), in branch streamk's
#   tree (.sk: main + the stream-K launch): proj_probe at M 8 writes the fastest variant
#   (split-K or stream-K) into .sk's linear table where it beats the table's config by
#   >= 0.5 us a launch; the branch's GPU GEMM tests (split-K and stream-K under graph
#   replay); then, if the table changed, bench dflash2-step 1 x 1k on main vs .sk, two
#   rounds; then proj_probe at M 1 and 16 for the record.
set -u
O=$OUT; t0=$(date +%s); gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export OP_CHECK=0
case "$gpu" in
  *H200*) bash benchmarks/results/session35-2026-12-06/call1.sh ;;
  *)
    OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; grep install $O/build.log
    [ -f .sk/setup.py ] || { echo "no .sk tree: make and carry it (see the top)"; exit 2; }
    python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.decompress(open(sys.argv[1], 'rb').read()))" \
      .sk/.prebuilt/_C.cpython-312-x86_64-linux-gnu.so.xz .sk/dflash_ops/_C.cpython-312-x86_64-linux-gnu.so
    sk() { (cd .sk && PYTHONPATH="$PWD:/tmp/site" "$@"); }
    sk timeout 200 python3 benchmarks/proj_probe.py --write-table dflash_ops/models/linear_table.json \
      > $O/proj_probe_m8.log 2>&1
    grep -E "^\||floor|write-table|rror" $O/proj_probe_m8.log; echo "proj_probe: $(( $(date +%s) - t0 )) s"
    sk timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_models_linear.py \
      -k "split_k_path" > $O/pytest_sk.log 2>&1
    tail -2 $O/pytest_sk.log; echo "tests: $(( $(date +%s) - t0 )) s"
    if ! cmp -s dflash_ops/models/linear_table.json .sk/dflash_ops/models/linear_table.json; then
      OUT=$O/c COMPARE_SUITES=dflash2-step COMPARE_TREES="main:. sk:.sk" ROUNDS=2 \
        bash benchmarks/gpu_check.sh compare > $O/cmp_call.log 2>&1
      grep -E "^==|dflash2-step\] B|rror" $O/cmp_call.log | head -16
      echo "compare: $(( $(date +%s) - t0 )) s"
    fi
    for m in 1 16; do
      sk timeout 90 python3 benchmarks/proj_probe.py --m $m --nw 8 > $O/proj_probe_m$m.log 2>&1
      grep -E "^\|" $O/proj_probe_m$m.log
    done
    cp .sk/dflash_ops/models/linear_table.json $O/linear_table_sk.json ;;
esac
cd $O && tar czf /tmp/nx.tgz . && find . -mindepth 1 -delete && mv /tmp/nx.tgz next.tgz
echo "total: $(( $(date +%s) - t0 )) s"
