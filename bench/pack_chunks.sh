#!/usr/bin/env bash
# The one archive format the device packs travel in: PACK_DIR/site as tar + xz, split into chunks of
# <= CHUNK_BYTES (a device call carries at most 64 MiB, tree included), and PACK_DIR/MANIFEST naming the
# archive's and each chunk's sha256 and size and the site's packages. bench/unpack_sglang.sh reads it on
# the GPU machine (one chunk a call, gathered in /tmp while the machine stays warm) and unpacks
# DEST/site. Used by bench/pack_sglang.sh and bench/pack_te.sh after they fill PACK_DIR/site.
#
#   PACK_DIR=.te-pack CHUNK_BYTES=$((59 << 20)) XZ_LEVEL=6 bash bench/pack_chunks.sh
set -euo pipefail
PACK_DIR=${PACK_DIR:?PACK_DIR names the folder whose site/ is packed}
CHUNK_BYTES=${CHUNK_BYTES:-$((59 << 20))}
XZ_LEVEL=${XZ_LEVEL:-6}
site="$PACK_DIR/site"
[ -d "$site" ] || { echo "pack_chunks: $site is not a folder" >&2; exit 2; }
archive="$PACK_DIR/site.tar.xz"
rm -f "$PACK_DIR"/chunk-* "$PACK_DIR/MANIFEST" "$archive"
tar -C "$PACK_DIR" -cf - site | xz -T0 "-$XZ_LEVEL" > "$archive"
split -b "$CHUNK_BYTES" -d -a 2 "$archive" "$PACK_DIR/chunk-"
chunks=("$PACK_DIR"/chunk-*)
{
  echo "archive $(sha256sum "$archive" | cut -d' ' -f1) $(stat -c %s "$archive") ${#chunks[@]}"
  for c in "${chunks[@]}"; do
    echo "chunk $(basename "$c") $(sha256sum "$c" | cut -d' ' -f1) $(stat -c %s "$c")"
  done
  ls "$site" | grep -E '\.dist-info$' | sed 's/\.dist-info$//; s/^/package /'
} > "$PACK_DIR/MANIFEST"
rm -f "$archive"
