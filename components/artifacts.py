"""Run-addressed artifact storage: files and whole directories under `<prefix>/<run_id>/<name>/`.

Two backends behind one interface: a local directory (the default) and S3 or any S3-compatible store
(infra/s3/start.sh runs one locally). Each artifact carries a manifest (sha256 and size of every file) that is
written last: an artifact without one is incomplete and does not exist as far as readers are concerned, and
`get` checks every byte it hands back against it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.files import atomic_write_bytes, sha256_file

if TYPE_CHECKING:
    from components.config import StorageParams

MANIFEST = "_manifest.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MB = 1024 * 1024


class ArtifactError(RuntimeError):
    """An artifact could not be stored or loaded; the message says what failed and how to fix it."""


class ArtifactNotFoundError(ArtifactError):
    """No complete artifact (one with a manifest) under that run and name."""


class ArtifactCorruptError(ArtifactError):
    """Stored bytes do not match the artifact's manifest."""


def _check_name(kind: str, value: str) -> str:
    # One path segment each: keeps the layout unambiguous and list_runs/list_artifacts exact.
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value == MANIFEST:
        raise ValueError(f"{kind} {value!r}: use letters, digits, '.', '_' and '-', starting with a letter or digit")
    return value


def _files_of(src: Path) -> list[tuple[str, Path]]:
    """(relative posix path, file) pairs of a file or directory, sorted. Empty directories are not kept."""
    if src.is_file():
        return [(src.name, src)]
    if src.is_dir():
        return sorted((p.relative_to(src).as_posix(), p) for p in src.rglob("*") if p.is_file())
    raise ArtifactError(f"cannot store {src}: no such file or directory")


@dataclass(frozen=True)
class StoredRun:
    run_id: str
    stored_at: float  # when its newest artifact was stored (seconds since the epoch; 0 for manifests without a time)
    artifacts: list[str]  # names of its complete artifacts


class ArtifactStore(ABC):
    """put/get/exists/list over a key space; subclasses supply the few storage primitives below."""

    # -- storage primitives (keys are '/'-joined, relative to the store's root or prefix) --
    @abstractmethod
    def _write_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def _write_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _read_bytes(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""

    @abstractmethod
    def _download(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def _delete_tree(self, key: str) -> None: ...

    @abstractmethod
    def _children(self, key: str) -> list[str]:
        """Names of the immediate 'directories' under key."""

    @abstractmethod
    def uri(self, run_id: str, name: str) -> str: ...

    # -- the interface --
    def put(self, local_path: str | os.PathLike[str], run_id: str, name: str) -> str:
        """Store a file or a directory as run_id/name (replacing an earlier one); return its URI."""
        base = f"{_check_name('run_id', run_id)}/{_check_name('name', name)}"
        src = Path(local_path)
        files = _files_of(src)
        manifest: dict[str, Any] = {
            "kind": "file" if src.is_file() else "dir",
            "stored_at": time.time(),  # orders runs for `prune`
            "files": {rel: {"sha256": sha256_file(path), "size": path.stat().st_size} for rel, path in files},
        }
        # Replace, never merge: the old manifest goes first so a crash mid-way leaves no complete-looking mix.
        self._delete_tree(base)
        for rel, path in files:
            self._write_file(f"{base}/{rel}", path)
        self._write_bytes(f"{base}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
        return self.uri(run_id, name)

    def get(self, run_id: str, name: str, dest: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Materialise run_id/name at dest (a file for a file artifact, a directory for a directory), verified."""
        manifest = self.manifest(run_id, name)
        dest = Path(dest)
        if dest.exists() and not overwrite:
            raise ArtifactError(f"{dest} already exists; remove it or pass overwrite=True")
        base = f"{run_id}/{name}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Download beside dest and move into place only once every file checks out.
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
            staging = Path(tmp) / "artifact"
            for rel, meta in manifest["files"].items():
                if rel.startswith("/") or ".." in rel.split("/"):
                    raise ArtifactCorruptError(f"{self.uri(run_id, name)}: manifest names an unsafe path {rel!r}")
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self._download(f"{base}/{rel}", target)
                actual = sha256_file(target)
                if actual != meta["sha256"]:
                    raise ArtifactCorruptError(
                        f"{self.uri(run_id, name)}/{rel}: sha256 {actual} does not match the manifest's "
                        f"{meta['sha256']}; the stored copy is damaged or was changed: store the artifact again"
                    )
            if manifest["kind"] == "file":
                (only,) = manifest["files"]
                staging = staging / only
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            elif dest.exists() or dest.is_symlink():
                dest.unlink()
            if manifest["kind"] == "dir" and not manifest["files"]:
                staging.mkdir(parents=True, exist_ok=True)
            shutil.move(str(staging), dest)
        return dest

    def manifest(self, run_id: str, name: str) -> dict[str, Any]:
        raw = self._read_bytes(f"{_check_name('run_id', run_id)}/{_check_name('name', name)}/{MANIFEST}")
        if raw is None:
            raise ArtifactNotFoundError(
                f"no artifact {name!r} for run {run_id!r} at {self.uri(run_id, name)} "
                f"(runs here: {', '.join(self.list_runs()) or 'none'})"
            )
        return json.loads(raw)

    def exists(self, run_id: str, name: str) -> bool:
        key = f"{_check_name('run_id', run_id)}/{_check_name('name', name)}/{MANIFEST}"
        return self._read_bytes(key) is not None

    def list_runs(self) -> list[str]:
        return sorted(run for run in self._children("") if _NAME.fullmatch(run))

    def _manifests(self, run_id: str) -> dict[str, dict[str, Any]]:
        """The manifests of a run's complete artifacts, by name: one read each."""
        found = {}
        for name in self._children(_check_name("run_id", run_id)):
            raw = self._read_bytes(f"{run_id}/{name}/{MANIFEST}") if _NAME.fullmatch(name) else None
            if raw is not None:
                found[name] = json.loads(raw)
        return found

    def list_artifacts(self, run_id: str) -> list[str]:
        """Names of the complete artifacts of a run."""
        return sorted(self._manifests(run_id))

    def stored_runs(self) -> list[StoredRun]:
        """Every run, most recently stored first (runs stored before manifests had a time: last)."""
        runs = []
        for run_id in self.list_runs():
            manifests = self._manifests(run_id)
            newest = max((manifest.get("stored_at", 0.0) for manifest in manifests.values()), default=0.0)
            runs.append(StoredRun(run_id, newest, sorted(manifests)))
        return sorted(runs, key=lambda run: run.stored_at, reverse=True)

    def delete_run(self, run_id: str) -> None:
        """Remove every artifact of a run (manifests first, so no reader sees a half-deleted artifact)."""
        for name in self._children(_check_name("run_id", run_id)):
            self._delete_tree(f"{run_id}/{name}")
        self._delete_tree(run_id)

    def prune(self, keep: int, dry_run: bool = False) -> list[str]:
        """Delete all runs but the `keep` most recently stored; return the deleted (or, dry, deletable) run ids.

        Every pipeline run copies its models here, so the store grows by their size per run; DVC's remote keeps
        what `dvc.lock` names, so pruning old runs loses no version the repository can still check out.
        """
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least the newest run")
        old = [run.run_id for run in self.stored_runs()[keep:]]
        if not dry_run:
            for run_id in old:
                self.delete_run(run_id)
        return old


class LocalArtifactStore(ArtifactStore):
    """Artifacts under a local directory: root/<run_id>/<name>/..."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"LocalArtifactStore({str(self.root)!r})"

    def uri(self, run_id: str, name: str) -> str:
        return (self.root / run_id / name).as_uri()

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def _write_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)

    def _write_bytes(self, key: str, data: bytes) -> None:
        atomic_write_bytes(self._path(key), data)  # the manifest is there whole or not at all

    def _read_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _download(self, key: str, path: Path) -> None:
        try:
            shutil.copyfile(self._path(key), path)
        except FileNotFoundError:
            raise ArtifactCorruptError(f"{self._path(key)} is listed in the manifest but missing") from None

    def _delete_tree(self, key: str) -> None:
        target = self._path(key)
        if target.is_dir():
            shutil.rmtree(target)

    def _children(self, key: str) -> list[str]:
        folder = self._path(key)
        return [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []


class S3ArtifactStore(ArtifactStore):
    """Artifacts in s3://bucket/prefix/<run_id>/<name>/... on AWS or any S3-compatible store.

    Credentials come only from boto3's own chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...);
    the endpoint from endpoint_url, else boto3's AWS_ENDPOINT_URL, else AWS itself. The bucket is created if
    missing.
    """

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str = "us-east-1"):
        import boto3  # only S3 users pay for the import
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        session = boto3.session.Session(region_name=region)
        if session.get_credentials() is None:
            raise ArtifactError(
                "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE); "
                "for a local store run infra/s3/start.sh and export the variables it prints"
            )
        config = Config(
            # Path-style: S3-compatible stores (Swift s3api, MinIO) do not serve bucket subdomains.
            s3={"addressing_style": "path"},
            retries={"max_attempts": 5, "mode": "standard"},
            # Checksums only where S3 demands them: botocore >= 1.36 otherwise sends aws-chunked uploads with
            # trailing CRCs, which some S3-compatible stores reject. Integrity is ours: the sha256 manifest.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._s3 = session.client("s3", endpoint_url=endpoint_url, config=config)
        self.endpoint = self._s3.meta.endpoint_url
        # upload_file/download_file go multipart above the threshold: large model files stream in parts.
        self._transfer = TransferConfig(multipart_threshold=8 * _MB, multipart_chunksize=8 * _MB)
        self._ensure_bucket(region)

    def __repr__(self) -> str:
        return f"S3ArtifactStore(s3://{self.bucket}/{self.prefix}, endpoint={self.endpoint})"

    def uri(self, run_id: str, name: str) -> str:
        return f"s3://{self.bucket}/{self._key(f'{run_id}/{name}')}"

    def _key(self, key: str) -> str:
        return "/".join(part for part in (self.prefix, key) if part)

    def _fail(self, action: str, error: Exception) -> ArtifactError:
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        where = f"s3://{self.bucket} at {self.endpoint}"
        if isinstance(error, EndpointConnectionError):
            hint = "is the store running and AWS_ENDPOINT_URL / storage.s3.endpoint_url right? (infra/s3/start.sh)"
        elif isinstance(error, NoCredentialsError):
            hint = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        elif isinstance(error, ClientError) and error.response["Error"].get("Code") in (
            "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
        ):
            hint = "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and that they may use this bucket"
        else:
            hint = "see the error above"
        return ArtifactError(f"{action} on {where} failed: {error}; {hint}")

    def _ensure_bucket(self, region: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._s3.head_bucket(Bucket=self.bucket)
            return
        except ClientError as error:
            if error.response["Error"].get("Code") not in ("404", "NoSuchBucket"):
                raise self._fail("checking the bucket", error) from None
        except BotoCoreError as error:
            raise self._fail("checking the bucket", error) from None
        try:
            extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            self._s3.create_bucket(Bucket=self.bucket, **extra)
        except ClientError as error:
            if error.response["Error"].get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._fail("creating the bucket (create it yourself or fix the permissions)", error) from None
        except BotoCoreError as error:
            raise self._fail("creating the bucket", error) from None

    def _call(self, action: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except (BotoCoreError, ClientError) as error:
            raise self._fail(action, error) from None

    def _write_file(self, key: str, path: Path) -> None:
        self._call(f"uploading {path}", self._s3.upload_file, str(path), self.bucket, self._key(key),
                   Config=self._transfer)

    def _write_bytes(self, key: str, data: bytes) -> None:
        self._call(f"writing {key}", self._s3.put_object, Bucket=self.bucket, Key=self._key(key), Body=data)

    def _read_bytes(self, key: str) -> bytes | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self._s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as error:
            if error.response["Error"].get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._fail(f"reading {key}", error) from None
        except BotoCoreError as error:
            raise self._fail(f"reading {key}", error) from None

    def _download(self, key: str, path: Path) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._s3.download_file(self.bucket, self._key(key), str(path), Config=self._transfer)
        except ClientError as error:
            if error.response["Error"].get("Code") in ("NoSuchKey", "404"):
                raise ArtifactCorruptError(f"s3://{self.bucket}/{self._key(key)} is listed in the manifest "
                                           "but missing") from None
            raise self._fail(f"downloading {key}", error) from None
        except BotoCoreError as error:
            raise self._fail(f"downloading {key}", error) from None

    def _pages(self, key: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        prefix = self._key(key)
        paginator = self._s3.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=f"{prefix}/" if prefix else "", **kwargs)
        return self._call(f"listing {prefix or '/'}", list, pages)

    def _delete_tree(self, key: str) -> None:
        manifest = self._key(f"{key}/{MANIFEST}")
        self._call(f"deleting {manifest}", self._s3.delete_object, Bucket=self.bucket, Key=manifest)
        # One DeleteObject per key, not DeleteObjects: current botocore signs that with a CRC32 where
        # S3-compatible stores (Swift s3api) still demand Content-MD5.
        for page in self._pages(key):
            for obj in page.get("Contents", []):
                self._call(f"deleting {obj['Key']}", self._s3.delete_object, Bucket=self.bucket, Key=obj["Key"])

    def _children(self, key: str) -> list[str]:
        pages = self._pages(key, Delimiter="/")
        return [p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for page in pages for p in page.get("CommonPrefixes", [])]


def open_artifact_store(storage: StorageParams) -> ArtifactStore:
    """The store params.yaml's `storage` section names (local_dir is relative to the working directory)."""
    if storage.backend == "local":
        return LocalArtifactStore(storage.local_dir)
    if storage.backend == "s3":
        s3 = storage.s3
        return S3ArtifactStore(s3.bucket, s3.prefix, endpoint_url=s3.endpoint_url, region=s3.region)
    raise ValueError(f"storage.backend {storage.backend!r}: expected 'local' or 's3'")
