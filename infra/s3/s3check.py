"""Probe (and optionally create a bucket on) the local S3 endpoint, stdlib only.

Used by start.sh, which runs before any project venv exists, so no boto3: requests are signed with
AWS signature v2, which Swift's s3api accepts. Exit 0 when an authenticated ListBuckets succeeds.
usage: s3check.py ENDPOINT ACCESS_KEY SECRET_KEY [BUCKET]
"""
import base64
import hashlib
import hmac
import sys
import urllib.error
import urllib.request
from email.utils import formatdate


def request(endpoint: str, access: str, secret: str, method: str, path: str) -> int:
    date = formatdate(usegmt=True)
    # urllib adds a Content-Type to any request with a body, and v2 signs it: set it ourselves.
    content_type = "application/octet-stream" if method == "PUT" else ""
    string_to_sign = f"{method}\n\n{content_type}\n{date}\n{path}"
    signature = base64.b64encode(hmac.new(secret.encode(), string_to_sign.encode(), hashlib.sha1).digest())
    req = urllib.request.Request(endpoint + path, method=method, data=b"" if method == "PUT" else None)
    req.add_header("Date", date)
    if content_type:
        req.add_header("Content-Type", content_type)
    req.add_header("Authorization", f"AWS {access}:{signature.decode()}")
    try:
        with urllib.request.urlopen(req, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        # S3 explains a refusal in the body: <Code>InvalidBucketName</Code><Message>...</Message>
        if error.code != 409:
            print(f"{method} {path}: HTTP {error.code} {error.read(600).decode(errors='replace')}", file=sys.stderr)
        return error.code


def main() -> int:
    endpoint, access, secret, *bucket = sys.argv[1:]
    try:
        status = request(endpoint, access, secret, "GET", "/")
    except OSError as error:  # connection refused / reset while the servers come up
        print(f"not reachable: {error}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"ListBuckets returned HTTP {status}", file=sys.stderr)
        return 1
    if bucket:
        status = request(endpoint, access, secret, "PUT", f"/{bucket[0]}")
        # 409 BucketAlreadyOwnedByYou on a re-run is fine.
        if status not in (200, 409):
            print(f"creating bucket {bucket[0]!r} returned HTTP {status}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
