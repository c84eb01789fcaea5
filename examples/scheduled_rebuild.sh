#!/usr/bin/env bash
# One scheduled rebuild of one domain datastore from a growing corpus folder:
#   1. build: the first run builds the datastore from every file; later runs append only the
#      files whose content the newest version lacks (new rotated logs, new dumps), or report
#      "unchanged" and create nothing;
#   2. tag the newest version (engines opened on NAME@TAG switch to it between requests);
#   3. gc: keep the newest KEEP versions and every tagged one.
# Idempotent: a run over an unchanged folder creates no version and leaves the tag where it is.
# Files must be closed segments (rotate logs before they land here): a file that changed is
# read again whole by --append.
#
# usage: scheduled_rebuild.sh STORE NAME CORPUS_DIR [extra build options...]
#        (STORE: a directory or an s3://, gs://, az:// URI; storage options from the environment)
# environment: TAG (default prod), KEEP (default 3), PATTERN (default *.jsonl),
#              SPECSTORE (default: specstore on PATH)
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
store=$1 name=$2 corpus_dir=$3
shift 3
tag=${TAG:-prod} keep=${KEEP:-3} pattern=${PATTERN:-*.jsonl} specstore=${SPECSTORE:-specstore}

shopt -s nullglob
files=("$corpus_dir"/$pattern)
if [ ${#files[@]} -eq 0 ]; then
    echo "scheduled_rebuild: no $pattern files in $corpus_dir; nothing to build" >&2
    exit 0
fi
IFS=$'\n' files=($(printf '%s\n' "${files[@]}" | LC_ALL=C sort))  # a stable source order
unset IFS

case "$store" in
    *://*) ;;  # an object store: nothing to create
    *) mkdir -p "$store" ;;
esac
if [ "$("$specstore" versions --store "$store" --name "$name" --json)" = "[]" ]; then
    mode=()  # the first version: a full build
else
    mode=(--append)
fi
"$specstore" build --store "$store" --name "$name" --corpus "${files[@]}" "${mode[@]}" --tag "$tag" "$@"
"$specstore" gc --store "$store" --name "$name" --keep "$keep"
