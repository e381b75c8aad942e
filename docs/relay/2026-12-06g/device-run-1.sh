#!/bin/bash
# Device calls of 2026-12-06 (seventh session) on quiet cores; .before/ holds 144fb51 (the session's start).
# SECTIONS:
#   ttft  chat-multiturn TTFT added by `tokenrelay up --engine sim` (bench/ttft_pinned.sh, --compare), ROUNDS of
#         three interleaved runs: this tree with the routers' --idle-spin-ms 1000 (newspin), .before/ with the same
#         (oldspin), this tree without it (newplain)
#   tl    the first token's path step by step (docs/relay/2026-12-06f/cpu/timeline/, measurement only), this tree
#         with --idle-spin-ms 1000, one chat-multiturn run
#   tlab  the same, this tree (new) and .before/ (old) interleaved, ROUNDS, both with --idle-spin-ms 1000
#   enc   docs/relay/2026-12-06g/cpu/enc_one.py on core 1 (Tokenizer.encode against encode_batch of one input)
#   parts docs/relay/2026-12-06g/cpu/chat_encode_parts.py and encoder_tokenize.py on core 1 (the chat encode
#         back to back, after spinning and after sleeping)
set -u
SECTIONS=${SECTIONS:-ttft tl}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -V
SPIN="--router-arg=--idle-spin-ms=1000"
mkdir -p $W/ttft
on ttft && for r in $(seq ${ROUNDS:-3}); do for v in newspin oldspin newplain; do
  A=""; [ $v != newplain ] && A="$SPIN"
  T=.; [ $v = oldspin ] && T=.before
  UP_ARGS="$A" TREE=$T OUT=$W/ttft TAG=${v}$r DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  el "ttft $v $r"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/${v}${r}_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
done; done
if on tl; then
  cp docs/relay/2026-12-06f/cpu/timeline/sitecustomize.py /tmp/site/ 2>/dev/null || { mkdir -p /tmp/site; cp docs/relay/2026-12-06f/cpu/timeline/sitecustomize.py /tmp/site/; }
  rm -f /tmp/tlm.*
  TR_TL=/tmp/tlm UP_ARGS="$SPIN" OUT=$W/ttft TAG=tl DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py
  el "tl"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/tl_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
  cat /tmp/tlm.* > $W/ttft/tl_marks.txt; python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $W/ttft/tl_marks.txt | tee $W/ttft/tl_summ.txt
fi
tlrun() {  # $1 tag, $2 tree
  cp docs/relay/2026-12-06f/cpu/timeline/sitecustomize.py /tmp/site/; rm -f /tmp/tlm.*
  TR_TL=/tmp/tlm UP_ARGS="$SPIN" TREE=$2 OUT=$W/ttft TAG=$1 DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py
  el "$1"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/$1_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
  cat /tmp/tlm.* > $W/ttft/$1_marks.txt; python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $W/ttft/$1_marks.txt > $W/ttft/$1_summ.txt
}
on tlab && for r in $(seq ${ROUNDS:-2}); do for v in new old; do
  T=.; [ $v = old ] && T=.before
  tlrun tl${v}$r $T; cut -c1-58 $W/ttft/tl${v}${r}_summ.txt
done; done
on enc && for m in "spin 0.02" "sleep 0.02" "spin 0"; do taskset -c 1 python3 docs/relay/2026-12-06g/cpu/enc_one.py $m 2>&1 | grep -v tokenizer_loaded; done
on parts && { for g in 0 0.05; do taskset -c 1 python3 docs/relay/2026-12-06g/cpu/chat_encode_parts.py $g; done
  for m in "spin 0" "spin 0.02" "sleep 0.02" "sleep 0.15"; do taskset -c 1 python3 docs/relay/2026-12-06g/cpu/encoder_tokenize.py $m; done; } 2>&1 | grep -v tokenizer_loaded | tee $W/parts.txt
tar czf $OUT/run-$(echo $SECTIONS | tr ' ' '-').tgz -C $W .
