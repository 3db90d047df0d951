#!/usr/bin/env bash
# Diagnostics for the H200 crash (numbers streamed into an ostream inside dflash_ops._C segfault).
# Run after gpu_check.sh has built the extension. Output to stdout.
SO=$(ls dflash_ops/_C*.so)
echo "== link flags"
python3 -c "import sysconfig as s; [print(k, s.get_config_var(k)) for k in ('LDSHARED', 'LDCXXSHARED', 'LDFLAGS', 'CC', 'CXX')]"
env | grep -E "^(LDFLAGS|LDSHARED|CXX|CC|CFLAGS|CXXFLAGS)=" ; ldd "$SO" | grep -E "stdc|gcc_s"
echo "== backtrace (fmt_cpp 0)"
python3 -c "import torch, dflash_ops; torch.ops.dflash_probe.trace_segv(); print(torch.ops.dflash_probe.fmt_cpp(0))" 2>&1 | tail -30
echo "== load order"
python3 -c "import torch; torch.ops.load_library('$SO'); print('torch then _C:', torch.ops.dflash_probe.fmt_cpp(0))" 2>&1 | tail -2; echo "rc=$?"
python3 -c "import triton, torch; torch.ops.load_library('$SO'); print('triton, torch, _C:', torch.ops.dflash_probe.fmt_cpp(0))" 2>&1 | tail -2
echo "== bindings of _C's stream symbols"
LD_DEBUG=bindings LD_DEBUG_OUTPUT=/tmp/ldb python3 -c "import torch, dflash_ops" >/dev/null 2>&1
grep -h "_C.cpython" /tmp/ldb.* | grep -E "_M_insert|num_put|locale|basic_ostringstream|ios_base|basic_ios" | sed 's/^ *[0-9]*: *//' | sort | uniq | head -30
echo "== libs defining _ZNSo9_M_insertIlEERSoT_"
grep -h "_ZNSo9_M_insertIlEERSoT_" /tmp/ldb.* | sed 's/^ *[0-9]*: *//' | sort | uniq -c | head
echo "== std symbols defined by _C"
nm -DC --defined-only "$SO" | grep -E " (std::|__gnu_cxx)" | head -20
TL=$(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))")/_C/libtriton.so
echo "== libtriton exports of ostream/locale: $(nm -D --defined-only $TL 2>/dev/null | grep -cE '_ZNSo|_ZNSt6locale|num_put')"
