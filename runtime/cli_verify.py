"""``specstore verify``: hash every file of one version against its manifest's checksums.

Opening a version checks sizes and headers only (constant time at any size); this command reads
every byte. One summary line and exit 0 when every file matches; otherwise the CLI prints one
error line naming the first missing, resized or damaged file and exits 2.
"""

from __future__ import annotations

import argparse

from specstore.runtime.store import Store, verify_files


def run_verify(args: argparse.Namespace) -> int:
    store = Store.from_args(args)
    record = store.resolve(args.ref)
    files = record.manifest.files
    verify_files(store.location, files, full=True)  # ChecksumError names the file
    total = sum(info.num_bytes for info in files.values())
    print(f"{record.name}@{record.version}: {len(files)} files, {total} bytes, every checksum matches its manifest")
    return 0
