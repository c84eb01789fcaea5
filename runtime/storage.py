"""Where a store lives: a local directory or an object-store URI, and the one filesystem layer
every file that is not a Lance table goes through.

Owns parsing a store's location (``/path``, ``file:///path``, ``s3://bucket/prefix``,
``gs://...``, ``az://...``), its storage options (Lance's option names, from the environment as
the cloud SDKs read it and from repeated ``--storage-option KEY=VALUE``), the pyarrow
filesystem that reaches it, and small whole-file operations on paths relative to the store's
root (read, write, size, list, copy, delete). Lance tables are opened by LanceDB with the same
URI and options; memory maps need local files, which file_cache.py provides for remote stores.
Does not own what the files are (store.py, datastore.py, the pipelines).
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specstore.runtime.errors import SpecstoreError

REMOTE_SCHEMES = ("s3", "gs", "az")
"""Object stores LanceDB reaches; ``file`` and plain paths are local."""

# Lance's S3 option names -> the environment variables the AWS SDKs read (first one set wins)
_S3_ENV = {
    "aws_access_key_id": ("AWS_ACCESS_KEY_ID",),
    "aws_secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "aws_session_token": ("AWS_SESSION_TOKEN",),
    "aws_region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "aws_endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "allow_http": ("AWS_ALLOW_HTTP",),
}
_TRUE = {"1", "true", "yes", "on"}


def split_uri(uri: str) -> tuple[str, str]:
    """``(scheme, rest)``: ``("s3", "bucket/prefix")``, ``("", "/abs/path")`` for local paths."""
    scheme, sep, rest = str(uri).partition("://")
    if not sep:
        return "", str(uri)
    scheme = scheme.lower()
    if scheme == "file":
        return "", rest
    if scheme not in REMOTE_SCHEMES:
        raise SpecstoreError(f"unsupported store URI {uri!r}: use a local path or one of "
                             f"{', '.join(s + '://' for s in REMOTE_SCHEMES)}")
    rest = rest.strip("/")
    if not rest:
        raise SpecstoreError(f"store URI {uri!r} names no bucket")
    return scheme, rest


def is_remote(uri: str | os.PathLike) -> bool:
    return split_uri(str(uri))[0] != ""


def parse_storage_options(items: Iterable[str] | None) -> dict[str, str]:
    """``["aws_region=eu-west-1", ...]`` -> ``{"aws_region": "eu-west-1"}`` (a repeated key: the last wins)."""
    options: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecstoreError(f"storage option {item!r} is not KEY=VALUE (e.g. aws_region=us-east-1)")
        options[key] = value
    return options


def options_from_env(scheme: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The storage options the environment gives for ``scheme`` (S3: the AWS SDKs' variables)."""
    environ = os.environ if environ is None else environ
    found: dict[str, str] = {}
    if scheme == "s3":
        for option, names in _S3_ENV.items():
            for name in names:
                if environ.get(name):
                    found[option] = environ[name]
                    break
    return found


@dataclass(frozen=True)
class Location:
    """A store's root: ``Location.of("s3://bucket/stores/main", {"aws_region": "..."})``.

    ``storage_options``: what was given; ``options``: those over the environment's, as LanceDB
    and the filesystem get them. Paths given to the methods are relative to the root, with '/'.
    """

    uri: str
    storage_options: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, root: str | os.PathLike | Location, storage_options: Mapping[str, str] | None = None) -> Location:
        if isinstance(root, Location):
            return root if not storage_options else cls(root.uri, {**root.storage_options, **storage_options})
        scheme, rest = split_uri(str(root))
        if scheme:
            return cls(f"{scheme}://{rest}", dict(storage_options or {}))
        return cls(str(Path(rest).expanduser().resolve()), dict(storage_options or {}))

    # ---- naming ------------------------------------------------------------------------------
    @property
    def scheme(self) -> str:
        return split_uri(self.uri)[0]

    @property
    def remote(self) -> bool:
        return self.scheme != ""

    @property
    def local_root(self) -> Path:
        if self.remote:
            raise SpecstoreError(f"internal: {self.uri} is not a local directory")
        return Path(self.uri)

    @property
    def options(self) -> dict[str, str]:
        return {**options_from_env(self.scheme), **self.storage_options} if self.remote else dict(self.storage_options)

    def child(self, *parts: str) -> str:
        """The URI (remote) or absolute path (local) of ``parts`` under the root."""
        rel = posixpath.join(*parts) if parts else ""
        if not self.remote:
            return str(Path(self.uri, rel)) if rel else self.uri
        return f"{self.uri}/{rel}" if rel else self.uri

    def _path(self, rel: str) -> str:
        """The filesystem's path of ``rel``: ``bucket/prefix/rel`` remotely, absolute locally."""
        base = split_uri(self.uri)[1]
        return posixpath.join(base, rel) if rel else base

    def __str__(self) -> str:
        return self.uri

    # ---- the filesystem -------------------------------------------------------------------------
    @property
    def fs(self):
        options = self.options
        key = (self.scheme, split_uri(self.uri)[1].split("/")[0] if self.remote else "", tuple(sorted(options.items())))
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = _FILESYSTEMS[key] = _filesystem(self.scheme, options, self.uri)
        return fs

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self._path(rel)).type != pafs.FileType.NotFound

    def is_file(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self._path(rel)).type == pafs.FileType.File

    def size(self, rel: str) -> int | None:
        """Bytes of the file ``rel``, None when there is none."""
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self._path(rel))
        return info.size if info.type == pafs.FileType.File else None

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self._path(rel)) as handle:
            return handle.read()

    def open_input(self, rel: str):
        return self.fs.open_input_stream(self._path(rel))

    def open_seekable(self, rel: str):
        """``rel`` as a readable, seekable binary file (np.load of an .npz reads its end first)."""
        if not self.remote:
            return open(self._path(rel), "rb")
        return self.fs.open_input_file(self._path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole file so that readers see the old content or the new, never a part:
        an object PUT is atomic; a local file is written beside it and renamed."""
        path = self._path(rel)
        if self.remote:
            with self.fs.open_output_stream(path) as handle:
                handle.write(data)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)

    def upload(self, local: str | os.PathLike, rel: str) -> None:
        """Copy a local file to ``rel`` (streamed)."""
        if not self.remote:
            target = Path(self._path(rel))
            target.parent.mkdir(parents=True, exist_ok=True)
            if Path(local).resolve() != target.resolve():
                _copy_local(Path(local), target)
            return
        with open(local, "rb") as src, self.fs.open_output_stream(self._path(rel)) as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)

    def download(self, rel: str, local: str | os.PathLike) -> None:
        """Copy ``rel`` to the local path ``local`` (streamed)."""
        with self.fs.open_input_stream(self._path(rel)) as src, open(local, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)

    def copy(self, src_rel: str, dst_rel: str) -> None:
        """Copy a file within the store: a hard link where the filesystem has them, a
        server-side copy on object stores."""
        if not self.remote:
            target = Path(self._path(dst_rel))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)  # what a crashed run left there
            try:
                os.link(self._path(src_rel), target)
            except OSError:
                _copy_local(Path(self._path(src_rel)), target)
            return
        self.fs.copy_file(self._path(src_rel), self._path(dst_rel))

    def walk(self, rel: str) -> Iterator[tuple[str, bool, int, float | None]]:
        """``(path relative to the root, is a file, bytes, modified time or None)`` of every
        entry under ``rel``, recursively (object stores list files only)."""
        import pyarrow.fs as pafs

        base = self._path("")
        selector = pafs.FileSelector(self._path(rel), recursive=True, allow_not_found=True)
        for info in self.fs.get_file_info(selector):
            if info.type in (pafs.FileType.File, pafs.FileType.Directory):
                mtime = info.mtime.timestamp() if info.mtime is not None else None
                is_file = info.type == pafs.FileType.File
                yield posixpath.relpath(info.path, base), is_file, (info.size or 0) if is_file else 0, mtime

    def list_dir(self, rel: str) -> list[tuple[str, float | None]]:
        """``(name, modified time in seconds or None)`` of the entries directly under ``rel``."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self._path(rel), recursive=False, allow_not_found=True)
        out = []
        for info in self.fs.get_file_info(selector):
            mtime = info.mtime.timestamp() if info.mtime is not None else None
            out.append((posixpath.basename(info.path.rstrip("/")), mtime))
        return out

    def delete_file(self, rel: str) -> None:
        self.fs.delete_file(self._path(rel))

    def delete_dir(self, rel: str) -> None:
        """Remove ``rel`` and everything under it (nothing when it does not exist)."""
        if self.exists(rel):
            self.fs.delete_dir(self._path(rel))


_FILESYSTEMS: dict[tuple, object] = {}  # one per scheme, bucket and options


def _copy_local(src: Path, dst: Path) -> None:
    import shutil

    temp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
    shutil.copyfile(src, temp)
    os.replace(temp, dst)


def _filesystem(scheme: str, options: Mapping[str, str], uri: str):
    import pyarrow.fs as pafs

    if scheme == "":
        return pafs.LocalFileSystem()
    if scheme == "s3":
        endpoint = options.get("aws_endpoint")
        allow_http = str(options.get("allow_http", "")).lower() in _TRUE
        kwargs = dict(access_key=options.get("aws_access_key_id"), secret_key=options.get("aws_secret_access_key"),
                      session_token=options.get("aws_session_token"), region=options.get("aws_region"))
        if endpoint:
            scheme_part, sep, host = endpoint.partition("://")
            if sep:
                if scheme_part == "http" and not allow_http:
                    raise SpecstoreError(f"endpoint {endpoint} is plain http: add the storage option allow_http=true")
                kwargs |= dict(endpoint_override=host, scheme=scheme_part)
            else:
                kwargs |= dict(endpoint_override=endpoint, scheme="http" if allow_http else "https")
        return pafs.S3FileSystem(**{k: v for k, v in kwargs.items() if v is not None})
    if scheme == "az":  # Lance's Azure option names (and the SDK's environment variables)
        name = options.get("azure_storage_account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        if not name:
            raise SpecstoreError(f"{uri}: give the storage option azure_storage_account_name (or AZURE_STORAGE_ACCOUNT_NAME)")
        key = options.get("azure_storage_account_key") or os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
        sas = options.get("azure_storage_sas_token") or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
        return pafs.AzureFileSystem(name, account_key=key, sas_token=sas)
    # gs://: pyarrow's filesystem with the credentials Google's SDK finds (GOOGLE_APPLICATION_CREDENTIALS, ...)
    try:
        fs, _ = pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError per backend
        raise SpecstoreError(f"cannot reach {uri}: {exc}") from None
    return fs
