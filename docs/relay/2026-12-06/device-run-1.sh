#!/bin/bash
# Device run 1 of 2026-12-06, one call, ~400 s. First: chat-multiturn TTFT added on quiet cores, `up --engine sim`
# as of 2b80ceb (the sim replying in printable ASCII, the routers (de)tokenizing short prompts in process) against
# the same tree set back to before it ("old": the sim over every id, the routers calling the tokenizer service),
# interleaved new/old/new. Then the 2026-12-05 script (never run: every call that session was refused): asyncio
# against uvloop in the relay, one token per message beside the bare server, 3 routers against one simulated
# H200 (left out unless SECTIONS names h200: measured before), and scenario d.
set -u
mkdir -p /tmp/o/ttft
OLD_ENV="TOKENRELAY_ROUTER_DETOKENIZE=tokenizer TOKENRELAY_ROUTER_TOKENIZE_LOCAL_BYTES=0"
OLD_UP="--engine-arg=--sim-sample-ids-from=0 --engine-arg=--sim-sample-ids-below=0"
for tag in new1 old1 new2; do
  if [[ $tag == old* ]]; then E=$OLD_ENV; U=$OLD_UP; else E=; U=; fi
  env $E UP_ARGS="$U" OUT=/tmp/o/ttft TAG=$tag DUR=20 COMPARE=1 TRACED=0 timeout 75 bash bench/ttft_pinned.sh > /dev/null 2>&1
  echo "ttft $tag: $(grep -E '^(TTFT p(50|99)|cached share)' /tmp/o/ttft/${tag}_compare.txt | sed 's/  */ /g' | tr '\n' ';')"
done
SECTIONS=${SECTIONS:-relay onetoken d} ROUNDS=1 bash docs/relay/2026-12-05/device-run-1.sh
tar czf $OUT/all.tgz -C /tmp/o .
