#!/usr/bin/env bash
# The device tool sends at most 64 MiB of the working tree; the tracked tree is ~100 MB, most of it
# trained heads and data the GPU check does not read. `sparse.sh on` leaves them out of the
# working tree (git sparse-checkout; nothing is deleted from the repository), `sparse.sh off`
# brings them back. Run `on` before the device call and `off` after it.
set -euo pipefail
case "${1:-}" in
  on)  git sparse-checkout set --no-cone '/*' '!/experiments/heads/' '!/experiments/data_engine/' \
         '!/specjax/artifacts/' '!/experiments/learning_curve/results/' '!/experiments/*/results/'
       du -sh --exclude=.git . ;;
  off) git sparse-checkout disable ;;
  *)   echo "usage: experiments/accelerator/sparse.sh on|off" >&2; exit 2 ;;
esac
