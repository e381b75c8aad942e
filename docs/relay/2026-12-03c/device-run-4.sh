#!/bin/bash
# Device run 4 of 2026-12-03c: device run 2's scenario d at 3fe565f (a full queue answered without waiting
# for the id claim), the memo and the memo with local (de)tokenization, twice each.
MODES="memo local" exec bash "$(dirname "$0")/device-run-2.sh"
