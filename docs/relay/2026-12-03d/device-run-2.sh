#!/bin/bash
# Device run 2 of 2026-12-03d: run 1 again after two bench fixes (the bare server spun on the router's CPU
# while idle, and with fewer load processes than routers only 3 of 9 routers got traffic), with four
# simulated H200s behind 8 router processes instead of 9 (one more core for a fourth load process).
G4="--calibrated --engines 4 --streams 1024 4096 --duration 8 --warmup 2 --routers 8 --router-cpus 0-7 --redis-cpus 8 --tokenizer-cpus 9 --engine-cpus 10-11 --clients 4 --client-cpus 12-15" \
  exec bash docs/relay/2026-12-03d/device-run-1.sh
