#!/bin/bash
# chat-multiturn with submit-before-grant on (the default then, --submit-before-grant 4) and off (0), the same
# tree, interleaved, with the first token's path step by step and the router's submit-before-grant counter: the
# eighth session's A/B script with this option (ran at 7d83550; the option was removed after, docs/benchmarks.md).
# OUT=dir ROUNDS=n SPIN=1000 bash docs/relay/2026-12-06i/cpu/sbgab.sh
OUT=${OUT:-/tmp/sbgab} FLAG=submit-before-grant ON=4 METRICS="^tokenrelay_router_submit_before_grant_total" \
  exec bash "$(dirname "$0")/../../2026-12-06h/cpu/prefetchab.sh"
