#!/usr/bin/env bash
# Device side of bench/pack_sglang.sh (and of every pack in bench/pack_chunks.sh's format: bench/pack_te.sh's,
# with PACK_DIR=.te-pack DEST=/tmp/te-site): the pack is one chunk today, so one device call carrying
# .sglang-pack/MANIFEST and .sglang-pack/chunk-00 unpacks it (bench/device_sglang.sh runs this script itself
# when the MANIFEST came with the call). A pack of several chunks (CHUNK_BYTES smaller) still works one
# chunk a call on the same warm machine, each call carrying the MANIFEST and its chunk. The chunks gather in
# $DEST/.chunks (default /tmp/sglang-site, which outlives the call while the machine stays warm);
# each is checked against the MANIFEST's sha256. Once all are there, the archive is checked,
# unpacked into $DEST/site and a marker written; then `export PYTHONPATH=$DEST/site:$PYTHONPATH`
# makes SGLang, FlashInfer and the router importable (bench/device_sglang.sh does it).
#
# Concurrent runs for one $DEST take turns (a lock file in it).
#
# Exit 0: complete (unpacked now or before); 75: chunks still missing (named, with the carry to use);
# 2: no MANIFEST, or a chunk that does not match it.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK_DIR=${PACK_DIR:-.sglang-pack}
DEST=${DEST:-/tmp/sglang-site}
manifest="$PACK_DIR/MANIFEST"
[ -f "$manifest" ] || { echo "unpack_sglang: no $manifest (bash bench/pack_sglang.sh on the CPU machine, then carry it)" >&2; exit 2; }
# one unpack at a time per $DEST: lanes of one device call (bench/device_lanes.sh) that each start SGLang run this
# together; the later ones wait here, then find the site complete
mkdir -p "$DEST"
exec 9>"$DEST/.lock"
if command -v flock >/dev/null; then flock 9; else echo "unpack_sglang: no flock here: unpacks started together may collide" >&2; fi
archive_sha=$(awk '$1 == "archive" {print $2}' "$manifest")
if [ -f "$DEST/.unpacked" ] && [ "$(cat "$DEST/.unpacked")" = "$archive_sha" ]; then
  echo "unpack_sglang: $DEST/site is complete (archive $archive_sha)"
  exit 0
fi
mkdir -p "$DEST/.chunks"
# what this call brought: checked, then kept for the calls to come
for c in "$PACK_DIR"/chunk-*; do
  [ -e "$c" ] || continue
  name=$(basename "$c")
  want=$(awk -v n="$name" '$1 == "chunk" && $2 == n {print $3}' "$manifest")
  [ -n "$want" ] || { echo "unpack_sglang: $name is not in $manifest (a chunk of another pack?)" >&2; exit 2; }
  got=$(sha256sum "$c" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "unpack_sglang: $name sha256 $got, the MANIFEST says $want (a broken copy)" >&2; exit 2; }
  cp "$c" "$DEST/.chunks/$name"
done
missing=()
have=0
while read -r kind name sha size; do
  [ "$kind" = chunk ] || continue
  if [ -f "$DEST/.chunks/$name" ] && [ "$(sha256sum "$DEST/.chunks/$name" | cut -d' ' -f1)" = "$sha" ]; then
    have=$((have + 1))
  else
    missing+=("$name")
  fi
done < "$manifest"
total=$((have + ${#missing[@]}))
if [ ${#missing[@]} -gt 0 ]; then
  echo "unpack_sglang: $have of $total chunks in $DEST/.chunks; still missing: ${missing[*]}"
  echo "  next call: carry [\"$PACK_DIR/MANIFEST\", \"$PACK_DIR/${missing[0]}\"], command: bash bench/unpack_sglang.sh"
  exit 75
fi
names=$(awk '$1 == "chunk" {print $2}' "$manifest")
got=$(cd "$DEST/.chunks" && cat $names | sha256sum | cut -d' ' -f1)
[ "$got" = "$archive_sha" ] || { echo "unpack_sglang: the joined chunks' sha256 $got is not the archive's $archive_sha" >&2; exit 2; }
rm -rf "$DEST/site"
(cd "$DEST/.chunks" && cat $names) | xz -d | tar -x -C "$DEST"
echo "$archive_sha" > "$DEST/.unpacked"
rm -rf "$DEST/.chunks"
echo "unpack_sglang: $total chunks joined and unpacked into $DEST/site ($(du -sh "$DEST/site" | cut -f1));" \
     "export PYTHONPATH=$DEST/site:\$PYTHONPATH"
