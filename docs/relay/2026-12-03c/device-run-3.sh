#!/bin/bash
# Device run 3 of 2026-12-03c: device run 2's scenario d runs again at be9c48d (budget refusals decided
# before the id claim).
exec bash "$(dirname "$0")/device-run-2.sh"
