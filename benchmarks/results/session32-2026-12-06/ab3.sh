#!/usr/bin/env bash
# one-off A/B on an H100: old (2fa861c), main, fold (the branch), main with the table off;
# the H200 linear table forced on (TABLE_GPU = None) unless AB_ANY is empty
set -u
O=$OUT; root=$PWD; t0=$(date +%s)
for d in . .old .fold; do
  sed -i 's/^TABLE, EXACT_TABLE, TABLE_GPU = _load()$/&\nif __import__("os").environ.get("AB_ANY"): TABLE_GPU = None/' $d/dflash_ops/models/linear.py
  grep -n "AB_ANY" $d/dflash_ops/models/linear.py
done
OP_CHECK=0 OUT=$O/b bash benchmarks/gpu_check.sh build > $O/build.log 2>&1; tail -3 $O/build.log
h=$(bash benchmarks/prebuild_hash.sh)
for d in .old .fold; do
  python3 -c "import lzma,sys;open(sys.argv[2],'wb').write(lzma.decompress(open(sys.argv[1],'rb').read()))" \
    $d/.prebuilt/_C.cpython-312-x86_64-linux-gnu.so.xz $d/dflash_ops/_C.cpython-312-x86_64-linux-gnu.so
  (cd $d && PYTHONPATH=$PWD python3 -c "import dflash_ops, dflash_ops._C; print(dflash_ops.__file__)")
done
(cd .fold && PYTHONPATH=$PWD timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_glu_proj.py > $O/fold_tests.log 2>&1; tail -3 $O/fold_tests.log)
echo "prep: $(( $(date +%s) - t0 )) s"
run() {  # name dir anyflag round
  (cd $2 && AB_ANY=$3 PYTHONPATH=$PWD DFLASH_OPS_COMMIT=$1 timeout 200 python3 benchmarks/bench_e2e.py --quick --no-plot \
     --out $O/e-$1-$4 > $O/e_$1_$4.log 2>&1)
  echo "== $1 round $4: $(( $(date +%s) - t0 )) s"; grep -E "^\[e2e\] B=" $O/e_$1_$4.log
}
for r in 1 2; do
  if [ $r = 2 ] && [ $(( $(date +%s) - t0 )) -gt ${R2_AFTER:-330} ]; then echo "no round 2"; break; fi
  run old .old 1 $r; run main . 1 $r; run fold .fold 1 $r; run main-notable . "" $r
done
echo "total: $(( $(date +%s) - t0 )) s"
