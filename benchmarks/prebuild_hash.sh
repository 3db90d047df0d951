#!/usr/bin/env bash
# The hash of what dflash_ops._C is built from (csrc/, setup.py, prebuild.sh), for .prebuilt/stamp.
cd "$(dirname "$0")/.." && cat $(ls csrc/* | LC_ALL=C sort) setup.py benchmarks/prebuild.sh \
  | sha256sum | cut -c1-16
