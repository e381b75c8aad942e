#!/bin/bash
# Device run 1 of 2026-12-06: the 2026-12-05 script (never run: every call that session was refused), then
# chat-multiturn TTFT added on uvloop with the span breakdown (bench/ttft_pinned.sh). One call, ~480 s.
set -u
bash docs/relay/2026-12-05/device-run-1.sh
mkdir -p /tmp/o/ttft
TOKENRELAY_EVENT_LOOP=uvloop OUT=/tmp/o/ttft TAG=uvloop DUR=20 timeout 150 bash bench/ttft_pinned.sh
tar czf $OUT/all.tgz -C /tmp/o .
