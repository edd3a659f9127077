#!/usr/bin/env bash
# A folder too large for one device call (a real model: SmolLM2-135M-Instruct is 270 MB; a call
# carries 64 MiB in all), sent over several calls of one warm lease in pieces.
#   here:  bash scripts/carry_pieces.sh split SRC_DIR [PIECE_MB]
#          -> .cache/pieces/NAME.tgz.NN (NAME = SRC_DIR's name) and NAME.sha256; carry one piece a call,
#             e.g. carry [".cache/pieces/NAME.tgz.00", ".cache/pieces/NAME.sha256"]
#   there: bash scripts/carry_pieces.sh gather NAME
#          -> each call keeps the pieces it carried in /tmp/pieces; once all are there, /tmp/models/NAME
#             (checked against the checksum). Prints what is still missing.
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
  split)
    src=${2:?SRC_DIR}; mb=${3:-55}; name=$(basename "$src")
    mkdir -p .cache/pieces && rm -f ".cache/pieces/$name".*
    tar -czf - -C "$(dirname "$src")" "$name" | split -b "${mb}m" -d - ".cache/pieces/$name.tgz."
    (cd .cache/pieces && cat "$name".tgz.* | sha256sum | cut -d' ' -f1 >"$name.sha256" \
      && ls "$name".tgz.* | wc -l >"$name.count")
    ls -la .cache/pieces/"$name".* ;;
  gather)
    name=${2:?NAME}; mkdir -p /tmp/pieces /tmp/models
    cp .cache/pieces/"$name".* /tmp/pieces/ 2>/dev/null || true
    [ -d "/tmp/models/$name" ] && { echo "/tmp/models/$name is there"; exit 0; }
    want=$(cat "/tmp/pieces/$name.count" 2>/dev/null || echo "?")
    have=$(ls /tmp/pieces/"$name".tgz.* 2>/dev/null | wc -l)
    if [ "$want" != "$have" ]; then echo "$name: $have of $want pieces here"; exit 0; fi
    [ "$(cat /tmp/pieces/"$name".tgz.* | sha256sum | cut -d' ' -f1)" = "$(cat "/tmp/pieces/$name.sha256")" ] \
      || { echo "$name: checksum mismatch"; exit 1; }
    cat /tmp/pieces/"$name".tgz.* | tar -xzf - -C /tmp/models && echo "/tmp/models/$name ready" ;;
  *) echo "usage: $0 split SRC_DIR [PIECE_MB] | gather NAME"; exit 2 ;;
esac
