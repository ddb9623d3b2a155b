#!/usr/bin/env bash
# Instructions per cache-hit pair: callgrind totals at N=1000 and N=2000, difference / 1000.
# usage: pair_count.sh BINARY OUTFILE
bin=$1; out=$2; : > "$out"
for bytes in 2097152 67108864 536870912; do
  for n in 1000 2000; do
    ir=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" $bytes $n 2>&1 | grep -oP 'Collected : \K[0-9]+')
    echo "$bytes $n $ir" >> "$out"
  done
done
awk '{k=$1; if ($2==1000) a[k]=$3; else b[k]=$3} END {for (k in a) printf "pair %s bytes: %.0f instructions\n", k, (b[k]-a[k])/1000}' "$out" | sort -n -k2 >> "$out"
