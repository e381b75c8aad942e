#!/bin/bash
# Device calls of 2026-12-06 (eighth session) on quiet cores: the chat prefetch (--chat-prefetch-max-in-flight,
# default 32) on and off, this tree, the routers with --idle-spin-ms 1000.
# SECTIONS:
#   ttft  chat-multiturn TTFT added by `tokenrelay up --engine sim` (bench/ttft_pinned.sh, --compare), ROUNDS of
#         two interleaved runs: prefetch on (pfon) and off (pfoff)
#   tlab  the first token's path step by step (docs/relay/2026-12-06f/cpu/timeline/, measurement only), prefetch
#         on and off interleaved, ROUNDS
#   parts docs/relay/2026-12-06g/cpu/chat_encode_parts.py and encoder_tokenize.py on core 1
#   lean  the one-coroutine prototype (cpu/lean/, measurement only; ENQUEUE before the encode) and the full
#         request core (its timeline), interleaved, ROUNDS, prefetch on (the default) for both
#   abl   the full path and all four parts out (cpu/ablate/: tracing, the id claim, the session read, metric
#         updates; measurement only), interleaved, ROUNDS
set -u
SECTIONS=${SECTIONS:-ttft}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -V
SPIN="--router-arg=--idle-spin-ms=1000"
OFF="--router-arg=--chat-prefetch-max-in-flight=0"
mkdir -p $W/ttft
on ttft && for r in $(seq ${ROUNDS:-3}); do for v in pfon pfoff; do
  A="$SPIN"; [ $v = pfoff ] && A="$SPIN $OFF"
  UP_ARGS="$A" OUT=$W/ttft TAG=${v}$r DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  el "ttft $v $r"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/${v}${r}_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
done; done
tlrun() {  # $1 tag, $2 extra up args
  mkdir -p /tmp/site; cp docs/relay/2026-12-06f/cpu/timeline/sitecustomize.py /tmp/site/; rm -f /tmp/tlm.*
  TR_TL=/tmp/tlm UP_ARGS="$SPIN $2" OUT=$W/ttft TAG=$1 DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py
  el "$1"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/$1_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
  cat /tmp/tlm.* > $W/ttft/$1_marks.txt; python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $W/ttft/$1_marks.txt > $W/ttft/$1_summ.txt
}
on tlab && for r in $(seq ${ROUNDS:-1}); do for v in pfon pfoff; do
  A=""; [ $v = pfoff ] && A="$OFF"
  tlrun tl${v}$r "$A"; cut -c1-58 $W/ttft/tl${v}${r}_summ.txt
done; done
site() {  # $1: the sitecustomize.py to use (copied to /tmp/site, first on PYTHONPATH)
  mkdir -p /tmp/site; cp $1 /tmp/site/sitecustomize.py
}
TLSITE=$ROOT/docs/relay/2026-12-06f/cpu/timeline/sitecustomize.py
pinned() {  # $1 tag: one pinned chat-multiturn run, its TTFT line
  UP_ARGS="$SPIN" OUT=$W/ttft TAG=$1 DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py
  el "$1"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/$1_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
}
on lean && for r in $(seq ${ROUNDS:-2}); do
  site docs/relay/2026-12-06h/cpu/lean/sitecustomize.py; rm -f /tmp/lm.*
  TR_LEAN=/tmp/lm pinned lean$r; cat /tmp/lm.* > $W/ttft/lean${r}_marks.txt
  python3 docs/relay/2026-12-06h/cpu/lean/summ.py $W/ttft/lean${r}_marks.txt | tee $W/ttft/lean${r}_summ.txt
  site $TLSITE; rm -f /tmp/tlm.*
  TR_TL=/tmp/tlm pinned leanfull$r; cat /tmp/tlm.* > $W/ttft/leanfull${r}_marks.txt
  python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $W/ttft/leanfull${r}_marks.txt | tee $W/ttft/leanfull${r}_summ.txt | grep "submit posted  "
done
on abl && for r in $(seq ${ROUNDS:-2}); do for v in full all; do
  site docs/relay/2026-12-06h/cpu/ablate/sitecustomize.py; rm -f /tmp/tlm.*
  A=trace,claim,sticky,metrics; [ $v = full ] && A=""
  TR_TL_SITE=$TLSITE TR_ABL=$A TR_TL=/tmp/tlm pinned abl$v$r; cat /tmp/tlm.* > $W/ttft/abl$v${r}_marks.txt
  python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $W/ttft/abl$v${r}_marks.txt > $W/ttft/abl$v${r}_summ.txt
  grep "call arrived -> submit" $W/ttft/abl$v${r}_summ.txt
done; done
on parts && { for g in 0 0.05; do taskset -c 1 python3 docs/relay/2026-12-06g/cpu/chat_encode_parts.py $g; done
  for m in "spin 0" "spin 0.02" "sleep 0.02" "sleep 0.15"; do taskset -c 1 python3 docs/relay/2026-12-06g/cpu/encoder_tokenize.py $m; done; } 2>&1 | grep -v tokenizer_loaded | tee $W/parts.txt
tar czf $OUT/run-$(echo $SECTIONS | tr ' ' '-').tgz -C $W .
